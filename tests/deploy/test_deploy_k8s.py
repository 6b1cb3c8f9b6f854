"""Kubernetes manifests: parse, reference each other correctly, and agree with the image and the server."""
from __future__ import annotations

import pytest
import yaml

from drafters import drafter_names
from server.config import config_from_dict
from tests.deploy.deployfiles import (
    K8S, ROOT, adapter_exposed_names, adapter_rules, arg_defaults, k8s_docs, k8s_find, option, parse_dockerfile,
    serve_argv,
)

DOCKER = parse_dockerfile((ROOT / "Dockerfile").read_text())


def container() -> dict:
    pod = k8s_find("Deployment", "specserve")["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    return pod["containers"][0]


def pod_spec() -> dict:
    return k8s_find("Deployment", "specserve")["spec"]["template"]["spec"]


def served_config():
    """The config the pod serves: the --config file passed in args, found in the mounted ConfigMap."""
    c = container()
    argv = serve_argv(DOCKER, c["args"])
    assert "command" not in c, "keep the image's ENTRYPOINT (specserve serve --host 0.0.0.0 --port ...)"
    cfg_path = option(argv, "--config")
    mount = next(m for m in c["volumeMounts"] if cfg_path.startswith(m["mountPath"].rstrip("/") + "/"))
    vol = next(v for v in pod_spec()["volumes"] if v["name"] == mount["name"])
    cm = k8s_find("ConfigMap", vol["configMap"]["name"])
    key = cfg_path[len(mount["mountPath"].rstrip("/")) + 1:]
    assert key in cm["data"], f"ConfigMap {cm['metadata']['name']} has no key {key}"
    return argv, config_from_dict(yaml.safe_load(cm["data"][key]))


def container_port(name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in container()["ports"] if p["name"] == name_or_number)


def test_every_manifest_parses_and_is_a_k8s_object():
    docs = k8s_docs()
    assert len(docs) >= 5
    for path, d in docs:
        assert isinstance(d, dict), path
        assert d.get("apiVersion") and d.get("kind"), path
        if d["kind"] != "Kustomization":  # kustomize's own file needs no name
            assert d.get("metadata", {}).get("name"), path
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler"} <= kinds


def test_kustomization_lists_existing_files():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (K8S / res).is_file(), res
    assert {"deployment.yaml", "service.yaml", "configmap.yaml", "hpa.yaml"} <= set(kust["resources"])


def test_configmap_config_loads_and_port_matches():
    argv, cfg = served_config()
    assert cfg.drafter.name in drafter_names()
    port = int(option(argv, "--port") or cfg.server.port)
    assert port == cfg.server.port == 8000
    ports = container()["ports"]
    assert [p["containerPort"] for p in ports] == [port]
    assert (option(argv, "--host") or cfg.server.host) == "0.0.0.0"


def test_gpu_and_api_key_secret():
    c = container()
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in c["env"]}
    ref = env["SPECSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]
    assert "value" not in env["SPECSERVE_API_KEY"]
    assert option(serve_argv(DOCKER, c["args"]), "--api-key") is None, "a key on the command line leaks in `ps`"


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_probes_hit_health(probe):
    c = container()
    p = c[probe]["httpGet"]
    assert p["path"] == "/health"
    _, cfg = served_config()
    assert container_port(p["port"]) == cfg.server.port
    assert c[probe]["timeoutSeconds"] > 10, "/health may wait up to 10 s for the worker's answer"


def test_probe_delays_allow_for_model_load():
    c = container()
    s = c["startupProbe"]
    startup_budget = s.get("initialDelaySeconds", 0) + s["periodSeconds"] * s["failureThreshold"]
    assert startup_budget >= 120, "loading (or converting) the model must not get the container killed"
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30


def test_termination_grace_covers_prestop_and_drain():
    c = container()
    argv = serve_argv(DOCKER, c["args"])
    drain = float(option(argv, "--drain-timeout") or 30.0)
    pre = c.get("lifecycle", {}).get("preStop", {})
    pre_sleep = 0.0
    if "exec" in pre:
        cmd = pre["exec"]["command"]
        assert cmd[0] == "sleep"
        pre_sleep = float(cmd[1])
    elif "sleep" in pre:
        pre_sleep = float(pre["sleep"]["seconds"])
    grace = pod_spec()["terminationGracePeriodSeconds"]
    assert drain < grace
    assert pre_sleep + drain + 5 <= grace, "room for the worker to exit after the drain"


def test_runs_as_the_image_user():
    sc = pod_spec()["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert str(sc["runAsUser"]) == arg_defaults(DOCKER)["APP_UID"]
    assert container()["securityContext"]["allowPrivilegeEscalation"] is False


def test_service_selects_the_pods():
    svc = k8s_find("Service", "specserve")
    labels = k8s_find("Deployment", "specserve")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    dep_sel = k8s_find("Deployment", "specserve")["spec"]["selector"]["matchLabels"]
    assert dep_sel.items() <= labels.items()
    _, cfg = served_config()
    assert all(container_port(p["targetPort"]) == cfg.server.port for p in svc["spec"]["ports"])


def test_podmonitor_scrapes_the_metrics_port():
    pm = k8s_find("PodMonitor", "specserve")
    labels = k8s_find("Deployment", "specserve")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ep = pm["spec"]["podMetricsEndpoints"][0]
    assert container_port(ep["port"]) == 8000 and ep["path"] == "/metrics"
    ann = k8s_find("Deployment", "specserve")["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/path"] == "/metrics" and int(ann["prometheus.io/port"]) == 8000


def test_hpa_scales_the_deployment_on_an_adapter_metric():
    hpa = k8s_find("HorizontalPodAutoscaler", "specserve")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", "specserve")
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    pods_metrics = [m for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert pods_metrics
    exposed = adapter_exposed_names()
    for m in pods_metrics:
        assert m["pods"]["metric"]["name"] in exposed, (m, sorted(exposed))
        assert m["pods"]["target"]["type"] == "AverageValue"
    assert "specserve_requests_waiting" in {m["pods"]["metric"]["name"] for m in pods_metrics}


def test_adapter_rules_map_pods():
    for rule in adapter_rules():
        assert 'namespace!=""' in rule["seriesQuery"] and 'pod!=""' in rule["seriesQuery"]
        assert rule["resources"]["overrides"]["pod"]["resource"] == "pod"
        assert rule["resources"]["overrides"]["namespace"]["resource"] == "namespace"
        for tmpl in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert tmpl in rule["metricsQuery"]


# -- the Inference Extension's pool and endpoint picker (inference-pool.yaml) -----------------------------------------
def _gauges() -> dict[str, str]:
    """The server's metric families and their types, as its registry exposes them."""
    from server.metrics import Metrics

    return {m.name: m.type for m in Metrics("m", "none").registry.collect()}


def test_the_inference_pool_keeps_the_v1_crds_rules_and_selects_the_server_pods():
    """The rules InferencePool v1's CRD states (selector of 1..64 labels, 1..8 unique target ports, a picker
    reference with a name and, for a Service, its port, failureMode FailOpen or FailClose), and what they refer to."""
    pool = k8s_find("InferencePool", "specserve")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    labels = spec["selector"]["matchLabels"]
    assert 1 <= len(labels) <= 64 and set(spec) <= {"selector", "targetPorts", "endpointPickerRef", "appProtocol"}
    ports = [p["number"] for p in spec["targetPorts"]]
    assert 1 <= len(ports) <= 8 and len(set(ports)) == len(ports) and all(1 <= p <= 65535 for p in ports)
    pod_labels = k8s_find("Deployment", "specserve")["spec"]["template"]["metadata"]["labels"]
    assert labels.items() <= pod_labels.items()  # the server's pods
    epp_pod = k8s_find("Deployment", "specserve-epp")["spec"]["template"]["metadata"]["labels"]
    assert not labels.items() <= epp_pod.items()  # and not the picker's
    assert ports == [container_port("http")]
    ref = spec["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == "" and ref["name"]
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    svc = k8s_find("Service", ref["name"])
    port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    epp = k8s_find("Deployment", ref["name"])
    assert svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    (c,) = epp["spec"]["template"]["spec"]["containers"]
    grpc = next(p for p in c["ports"] if p["name"] == port["targetPort"])
    assert f"--grpc-port={grpc['containerPort']}" in c["args"] and f"--pool-name={pool['metadata']['name']}" in c["args"]


def test_the_picker_reads_the_servers_own_gauges():
    """The picker's config (mounted where --config-file says) names metrics the server exports, as gauges: queued
    and running requests and the KV-cache usage fraction; every plugin a profile uses is declared."""
    epp = k8s_find("Deployment", "specserve-epp")["spec"]["template"]["spec"]
    (c,) = epp["containers"]
    path = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--config-file="))
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    vol = next(v for v in epp["volumes"] if v["name"] == mount["name"])
    cfg = yaml.safe_load(k8s_find("ConfigMap", vol["configMap"]["name"])["data"][path.rsplit("/", 1)[1]])
    assert cfg["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]): p for p in cfg["plugins"]}
    extractor = plugins["core-metrics-extractor"]["parameters"]
    engine = next(e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"])
    gauges = _gauges()
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        assert gauges.get(engine[key]) == "gauge", (key, engine[key])
    for profile in cfg["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= set(plugins)
    for source in cfg["dataLayer"]["sources"]:
        assert source["pluginRef"] in plugins and {e["pluginRef"] for e in source["extractors"]} <= set(plugins)
    assert plugins["metrics-data-source"]["parameters"]["path"] == k8s_find(
        "PodMonitor", None)["spec"]["podMetricsEndpoints"][0]["path"]
