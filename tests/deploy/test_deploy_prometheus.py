"""promtool checks our Prometheus files, and a real Prometheus runs OUR config against a live server on loopback."""
from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest
import yaml

from tests.deploy.deployfiles import (
    DEPLOY, ROOT, adapter_queries, alert_rules, dashboard_exprs, dashboards, grafana_to_promql, tool,
)
from tests.server.conftest import free_port

PROM_DIR = DEPLOY / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_promtool_check_config():
    r = promtool("check", "config", "deploy/prometheus/prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_rules():
    r = promtool("check", "rules", "deploy/prometheus/alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_alert_unit_tests():
    r = promtool("test", "rules", "tests/deploy/alerts_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_alerts_cover_the_issue():
    names = {r["alert"] for r in alert_rules()}
    for needed in ("SpecserveTTFTP90High", "SpecserveAcceptanceRateCollapsed", "SpecserveRequestsWaitingHigh",
                   "SpecserveQueueGrowing", "SpecserveTargetDown", "SpecserveErrorRateHigh"):
        assert needed in names
    for r in alert_rules():
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


class Prometheus:
    """A Prometheus from our prometheus.yml, with only the scrape targets pointed at loopback."""

    def __init__(self, binary: str, tmp, specserve_target: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
        for job in cfg["scrape_configs"]:
            target = specserve_target if job["job_name"] == "specserve" else f"127.0.0.1:{self.port}"
            job["static_configs"] = [{"targets": [target]}]
        for rule_file in cfg["rule_files"]:  # relative to the config file: copy them beside the temp copy
            shutil.copy(PROM_DIR / rule_file, tmp / rule_file)
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.log = open(tmp / "prometheus.log", "w+")
        self.proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={tmp / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params) -> dict:
        r = httpx.get(self.url + path, params=params, timeout=10)
        return r.json()

    def query(self, q: str) -> dict:
        return self.get("/api/v1/query", query=q)

    def wait(self, what, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log.read()[-3000:]}")
            try:
                got = what()
                if got:
                    return got
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError("timed out waiting for Prometheus")
            time.sleep(0.5)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def prometheus(live_server, tmp_path_factory):
    p = Prometheus(tool("prometheus"), tmp_path_factory.mktemp("prom"), live_server.url.removeprefix("http://"))
    try:
        yield p
    finally:
        p.stop()


@pytest.mark.server
def test_prometheus_scrapes_our_series(prometheus):
    def received():
        res = prometheus.query('specserve_requests_received_total{job="specserve"}')["data"]["result"]
        return res if res and float(res[0]["value"][1]) >= 1 else None

    res = prometheus.wait(received)
    assert res[0]["metric"]["drafter"] == "ngram" and res[0]["metric"]["model"]
    up = prometheus.query('up{job="specserve"}')["data"]["result"]
    assert up and up[0]["value"][1] == "1"
    hist = prometheus.query('specserve_time_to_first_token_seconds_count{job="specserve"}')["data"]["result"]
    assert hist and float(hist[0]["value"][1]) >= 1


@pytest.mark.server
def test_prometheus_loads_our_alert_rules(prometheus):
    want = {r["alert"] for r in alert_rules()}

    def evaluated():
        groups = prometheus.get("/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if {r["name"] for r in rules} == want and all(r["health"] == "ok" for r in rules) else None

    rules = prometheus.wait(evaluated, timeout=60)  # loaded at start, evaluated within one evaluation_interval
    assert all(r["type"] == "alerting" and not r.get("lastError") for r in rules)
    # a healthy server fires nothing
    firing = prometheus.get("/api/v1/alerts")["data"]["alerts"]
    assert not [a for a in firing if a["state"] == "firing"], firing


@pytest.mark.server
def test_dashboard_and_adapter_queries_run_on_prometheus(prometheus):
    prometheus.wait(lambda: prometheus.query('up{job="specserve"}')["data"]["result"])
    for _, dash in dashboards():
        variables = [v["name"] for v in dash["templating"]["list"]]
        for expr in dashboard_exprs(dash):
            if expr.startswith("label_values("):  # Grafana's variable query: check the series it lists
                metric = expr[len("label_values("):].split(",")[0].split("{")[0]
                res = prometheus.query(metric)["data"]["result"]
                label = expr.rstrip(")").rsplit(",", 1)[1].strip()
                assert res and label in res[0]["metric"], expr
                continue
            q = grafana_to_promql(expr, variables)
            r = prometheus.query(q)
            assert r["status"] == "success", (expr, r)
    for q in adapter_queries():
        r = prometheus.query(q)
        assert r["status"] == "success", (q, r)
    # a per-drafter panel sees our drafter
    res = prometheus.query('sum by (drafter) (specserve_requests_running{drafter=~".*"})')["data"]["result"]
    assert [x["metric"]["drafter"] for x in res] == ["ngram"]
