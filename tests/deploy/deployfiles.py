"""Readers for the deployment files (Dockerfile, .dockerignore, compose, k8s, Prometheus, Grafana) used by the tests."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"

# `specserve_...` series named in a PromQL expression (a label value never starts like that in our files).
SERIES_RE = re.compile(r"\bspecserve_[A-Za-z0-9_]+\b")


# ---------------------------------------------------------------------------------------------------- Dockerfile
@dataclass
class Instruction:
    cmd: str                    # upper-case instruction, e.g. "RUN"
    raw: str                    # its arguments as written (continuations joined)
    line: int
    flags: dict = field(default_factory=dict)   # --name=value options (HEALTHCHECK, COPY, ...)

    @property
    def json_args(self) -> list[str] | None:
        """The exec form (`["a", "b"]`) as a list, else None."""
        s = self.raw.strip()
        if s.startswith("["):
            try:
                v = json.loads(s)
            except json.JSONDecodeError:
                return None
            return v if isinstance(v, list) and all(isinstance(x, str) for x in v) else None
        return None

    def words(self) -> list[str]:
        """Exec form as is, shell form split like a shell would."""
        j = self.json_args
        return j if j is not None else shlex.split(self.raw)


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments and blank lines dropped, `\\` continuations joined (comment lines inside
    a continuation are skipped, as Docker does), leading `--flag=value` options split off."""
    out: list[Instruction] = []
    buf, start = "", 0
    for no, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = no
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        cmd, _, rest = buf.strip().partition(" ")
        rest = rest.strip()
        flags = {}
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            k, _, v = flag[2:].partition("=")
            flags[k] = v
            rest = rest.strip()
        out.append(Instruction(cmd.upper(), rest, start, flags))
        buf = ""
    if buf:
        raise ValueError(f"Dockerfile ends inside a continuation (line {start})")
    return out


def arg_defaults(instrs: list[Instruction], before_from: bool | None = None) -> dict[str, str]:
    """ARG name -> default ('' when none); `before_from=True` only the global ARGs (usable in FROM)."""
    out, seen_from = {}, False
    for i in instrs:
        if i.cmd == "FROM":
            seen_from = True
        if i.cmd != "ARG" or (before_from is True and seen_from):
            continue
        for w in shlex.split(i.raw):
            k, _, v = w.partition("=")
            out[k] = v
    return out


def expand(s: str, env: dict[str, str]) -> str:
    def sub(m):
        name = m.group(1) or m.group(2)
        return env.get(name, "")
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", sub, s)


def image_is_pinned(image: str) -> bool:
    """A tag other than `latest`, or a digest."""
    if "@sha256:" in image:
        return True
    name = image.rsplit("/", 1)[-1]
    if ":" not in name:
        return False
    tag = name.split(":", 1)[1]
    return bool(tag) and tag != "latest"


def option(argv: list[str], name: str) -> str | None:
    """Value of `--name VALUE` or `--name=VALUE` in an argv (the last one wins, as with argparse)."""
    val = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            val = argv[i + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    return val


def serve_argv(instrs: list[Instruction], cmd_override: list[str] | None = None) -> list[str]:
    """The container's command line: ENTRYPOINT + CMD (or the CMD replacement of compose `command` / k8s `args`)."""
    entry = [i for i in instrs if i.cmd == "ENTRYPOINT"]
    cmd = [i for i in instrs if i.cmd == "CMD"]
    argv = entry[-1].words() if entry else []
    if cmd_override is not None:
        return argv + list(cmd_override)
    return argv + (cmd[-1].words() if cmd else [])


def container_path_to_repo(path: str, workdir: str) -> Path:
    """A path inside the image, relative to WORKDIR or absolute under it, as the repository file it was copied from
    (the Dockerfile copies repository paths to the same relative place under WORKDIR)."""
    p = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    prefix = workdir.rstrip("/") + "/"
    if not p.startswith(prefix):
        raise AssertionError(f"{path} is not under WORKDIR {workdir}")
    return ROOT / p[len(prefix):]


# ------------------------------------------------------------------------------------------------- .dockerignore
def _glob_re(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif c == "*":
            out, i = out + "[^/]*", i + 1
        elif c == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(c), i + 1
    return re.compile(out + r"\Z")


def dockerignore_patterns(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def is_ignored(rel: str, patterns: list[str]) -> bool:
    """Whether the build context leaves out `rel` (a path or any folder above it matched; `!` re-includes)."""
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        rx = _glob_re(pat.lstrip("!").strip().strip("/").removeprefix("./"))
        if any(rx.match(p) for p in prefixes):
            ignored = not neg
    return ignored


# ------------------------------------------------------------------------------------------ YAML / expressions
def load_yaml_docs(path: Path) -> list:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def k8s_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in sorted(K8S.glob("*.yaml")) for d in load_yaml_docs(p)]


def k8s_find(kind: str, name: str | None = None) -> dict:
    found = [d for _, d in k8s_docs() if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/k8s, found {len(found)}"
    return found[0]


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def adapter_rules() -> list[dict]:
    cm = k8s_find("ConfigMap", "prometheus-adapter")
    return yaml.safe_load(cm["data"]["config.yaml"])["rules"]


def adapter_exposed_names() -> dict[str, str]:
    """Custom-metric name served by the adapter -> the Prometheus series it comes from."""
    out = {}
    for rule in adapter_rules():
        for series in SERIES_RE.findall(rule["seriesQuery"]):
            matches, as_ = rule["name"]["matches"], rule["name"].get("as", "")
            name = re.sub(matches, re.sub(r"\$\{(\d+)\}", r"\\g<\1>", as_), series) if as_ else series
            out[name] = series
    return out


def adapter_queries() -> list[str]:
    """Adapter PromQL with its templates filled as the adapter would (for a real Prometheus)."""
    out = []
    for rule in adapter_rules():
        series = SERIES_RE.findall(rule["seriesQuery"])[0]
        q = (rule["metricsQuery"].replace("<<.Series>>", series)
             .replace("<<.LabelMatchers>>", 'namespace!=""').replace("<<.GroupBy>>", "namespace, pod"))
        out += [rule["seriesQuery"], q]
    return out


def dashboards() -> list[tuple[Path, dict]]:
    return [(p, json.loads(p.read_text())) for p in sorted(DASHBOARDS.glob("*.json"))]


def all_panels(dash: dict) -> list[dict]:
    out = []
    for p in dash.get("panels", []):
        out.append(p)
        out += p.get("panels", [])  # collapsed rows keep their panels inside
    return out


def dashboard_exprs(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in all_panels(dash) for t in p.get("targets", []) if t.get("expr")]
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if v.get("type") == "query" and q:
            exprs.append(q)
    return exprs


GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}


def grafana_to_promql(expr: str, variables: list[str]) -> str:
    """A panel expression as Prometheus would receive it: built-in intervals filled, `$var` = `.*` (All)."""
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    for name in variables:
        expr = expr.replace("${" + name + "}", ".*").replace("$" + name, ".*")
    return expr


def parse_duration(s: str | int | float) -> float:
    if isinstance(s, (int, float)):
        return float(s)
    total, units = 0.0, {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", s):
        total += float(num) * units[unit]
    return total


def tool(name: str) -> str:
    """Path of a Prometheus tool (Debian package `prometheus`): skip without it, fail in CI."""
    import pytest

    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed: `make test` installs the Debian package 'prometheus'")
        pytest.skip(f"{name} is not installed (Debian package 'prometheus'; `make test` installs it)")
    return path
