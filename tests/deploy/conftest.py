"""One real `specserve serve` (drafter ngram, no API key) shared by the deployment tests that need live metrics."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import metric, scrape, wait_until


@pytest.fixture(scope="session")
def live_server(open_server):
    """The session's server without an API key (tests/conftest.py), once it has answered one completion, so every
    histogram and counter has samples."""
    s = open_server
    r = httpx.post(s.url + "/v1/completions", timeout=120,
                   json={"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
                         "prompt": "one two three four, one two three four, one two three four, one two"})
    assert r.status_code == 200, r.text
    # the outcome is counted just after the reply went out
    assert wait_until(lambda: metric(scrape(s.url), "specserve_requests_total", outcome="completed") >= 1, 10), \
        "the completed request never showed in /metrics"
    return s


@pytest.fixture(scope="session")
def scraped_names(live_server) -> set[str]:
    """Every sample name in one scrape of the live server (counters with `_total`, histograms `_bucket/_sum/_count`)."""
    return {name for name, _ in scrape(live_server.url)}
