"""The dashboard, the alert rules and the autoscaling rules use only series the server really exports."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from server.metrics import OUTCOMES
from tests.deploy.deployfiles import (
    DEPLOY, ROOT, SERIES_RE, adapter_exposed_names, adapter_queries, alert_rules, all_panels, dashboard_exprs,
    dashboards, parse_dockerfile,
)

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def used_series() -> dict[str, set[str]]:
    """Series name -> the files whose expressions name it."""
    out: dict[str, set[str]] = {}

    def add(where, text):
        for name in SERIES_RE.findall(text):
            out.setdefault(name, set()).add(where)

    for path, dash in dashboards():
        for e in dashboard_exprs(dash):
            add(path.name, e)
    for rule in alert_rules():
        add("alerts.yml", rule["expr"])
    for q in adapter_queries():
        add("prometheus-adapter-rules.yaml", q)
    for series in adapter_exposed_names().values():
        add("hpa via adapter", series)
    return out


def test_expressions_name_series():
    used = used_series()
    # the dashboard covers the list; the alerts and the adapter use the serving metrics
    for needed in ("specserve_generation_tokens_total", "specserve_requests_received_total",
                   "specserve_time_to_first_token_seconds_bucket", "specserve_inter_token_latency_seconds_bucket",
                   "specserve_requests_running", "specserve_requests_waiting", "specserve_kv_cache_usage_ratio",
                   "specserve_spec_accepted_tokens_total", "specserve_spec_draft_tokens_total",
                   "specserve_spec_verify_steps_total", "specserve_spec_accepted_tokens_per_position_total",
                   "specserve_spec_accepted_length_sum", "specserve_spec_accepted_length_count",
                   "specserve_prefix_cache_hits_total", "specserve_prefix_cache_queries_total",
                   "specserve_prefix_cache_evictions_total", "specserve_kv_cache_cached_usage_ratio"):
        assert "specserve.json" in used.get(needed, set()), f"the dashboard does not show {needed}"
    assert "specserve_requests_waiting" in used and "hpa via adapter" in used["specserve_requests_waiting"]


@pytest.mark.server
def test_every_series_used_is_exported(scraped_names):
    used = used_series()
    assert used
    missing = {n: sorted(w) for n, w in used.items() if n not in scraped_names}
    assert not missing, f"series not in the server's /metrics: {missing}"
    # families, as a reader would name them: histograms by base name, counters with _total
    families = {n[: -len(s)] for n in used for s in HISTOGRAM_SUFFIXES if n.endswith(s)}
    for fam in families:
        assert f"{fam}_bucket" in scraped_names and f"{fam}_count" in scraped_names, fam


def test_outcome_label_values_are_real():
    texts = [e for _, d in dashboards() for e in dashboard_exprs(d)] + [r["expr"] for r in alert_rules()]
    values = {v for t in texts for v in re.findall(r'outcome\s*=~?\s*"([^"]+)"', t)}
    assert values and values <= set(OUTCOMES), values - set(OUTCOMES)


def test_dashboard_structure():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    uids = {d["uid"] for d in ds}
    for path, dash in dashboards():
        assert dash["uid"] and dash["title"]
        panels = all_panels(dash)
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        variables = {v["name"] for v in dash["templating"]["list"]}
        assert {"drafter", "model"} <= variables
        for p in panels:
            if p["type"] == "row":
                continue
            assert p["datasource"]["uid"] in uids, p["title"]
            assert p["targets"], p["title"]
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] in uids
                expr = t["expr"]
                if "specserve_" in expr:  # filtered by the dashboard's variables, broken down by drafter
                    assert 'drafter=~"$drafter"' in expr, (p["title"], expr)
                    if expr.startswith(("sum", "avg", "max", "histogram_quantile", "(")) and "by (" in expr:
                        assert re.search(r"by \([^)]*drafter", expr), (p["title"], expr)
                if "histogram_quantile" in expr:
                    assert re.search(r"by \([^)]*\ble\b", expr), (p["title"], expr)
        titles = " ".join(p["title"].lower() for p in panels)
        for word in ("tokens/s", "requests/s", "time to first token", "inter-token", "running / waiting", "kv-cache",
                     "acceptance rate", "mean accepted length", "position", "prefix cache"):
            assert word in titles, f"{path.name}: no panel about {word}"


def healthcheck_sources() -> list[str]:
    hc = [i for i in parse_dockerfile((ROOT / "Dockerfile").read_text()) if i.cmd == "HEALTHCHECK"][0]
    docker_src = json.loads(hc.raw.split(None, 1)[1])[2]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    compose_src = compose["services"]["specserve"]["healthcheck"]["test"][3]
    return [docker_src, compose_src]


@pytest.mark.server
@pytest.mark.parametrize("which", [0, 1], ids=["Dockerfile", "compose"])
def test_healthcheck_command_passes_on_a_healthy_server(live_server, which):
    src = healthcheck_sources()[which]
    live = src.replace("127.0.0.1:8000", f"127.0.0.1:{live_server.port}")
    assert live != src
    r = subprocess.run([sys.executable, "-c", live], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
