"""A real Prometheus server (Debian package `prometheus`) scrapes our /metrics on loopback."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import httpx
import pytest
import yaml

from tests.server.conftest import free_port

pytestmark = pytest.mark.server


@pytest.fixture
def prometheus_bin():
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed: `make test` installs the Debian package")
        pytest.skip("the Debian package 'prometheus' is not installed (make test installs it)")
    return path


def test_prometheus_scrapes_our_series(server, prometheus_bin, tmp_path):
    httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
               json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4})
    port = free_port()
    target = server.url.removeprefix("http://")
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "scrape_configs": [{"job_name": "specserve", "static_configs": [{"targets": [target]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, result = time.monotonic() + 60, []
        while time.monotonic() < deadline and not result:
            time.sleep(1)
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", timeout=5,
                              params={"query": "specserve_requests_received_total"})
                result = r.json()["data"]["result"] if r.status_code == 200 else []
            except httpx.HTTPError:
                pass
        assert result, "Prometheus never returned our series"
        assert result[0]["metric"]["job"] == "specserve" and float(result[0]["value"][1]) >= 1
        steps = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", timeout=5,
                          params={"query": "specserve_step_rows_count"}).json()["data"]["result"]
        assert steps and float(steps[0]["value"][1]) >= 4  # one batched step per token of the request at least
        up = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": "up"}, timeout=5).json()
        assert up["data"]["result"][0]["value"][1] == "1"
    finally:
        proc.terminate()
        proc.wait(10)
