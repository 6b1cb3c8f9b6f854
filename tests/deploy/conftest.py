"""One real `specserve serve` (drafter ngram, no API key) shared by the deployment tests that need live metrics."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import ServerProcess, metric, scrape


@pytest.fixture(scope="session")
def live_server(tmp_path_factory, target32):
    """A server that has answered one completion, so every histogram and counter has samples. Its draft budget is
    ``fixed``: the goodput budget drafts only where this machine's measured step costs say it pays, and on a CPU
    where it does not, no draft counter would ever get a sample."""
    s = ServerProcess(tmp_path_factory.mktemp("deploy-srv"), drafter="ngram", api_key=None,
                      server_options={"draft_budget": "fixed"})
    try:
        s.wait_ready()
        r = httpx.post(s.url + "/v1/completions", timeout=120,
                       json={"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
                             "prompt": "one two three four, one two three four, one two three four, one two"})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10  # the outcome is counted just after the reply went out
        while metric(scrape(s.url), "specserve_requests_total", outcome="completed") < 1:
            assert time.monotonic() < deadline, "the completed request never showed in /metrics"
            time.sleep(0.1)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def scraped_names(live_server) -> set[str]:
    """Every sample name in one scrape of the live server (counters with `_total`, histograms `_bucket/_sum/_count`)."""
    return {name for name, _ in scrape(live_server.url)}
