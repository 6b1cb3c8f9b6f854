"""Faults: client disconnects, worker death, SIGTERM drain."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from tests.server.conftest import metric, scrape, wait_balanced

LONG = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Write a very long essay."}],
        "max_tokens": 400, "stream": True, "ignore_eos": True}


def _wait(pred, timeout=20.0, step=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False


def test_disconnect_mid_stream_frees_the_slot(server):
    assert wait_balanced(server.url)
    aborted = metric(scrape(server.url), "specserve_requests_total", outcome="aborted")
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=LONG, headers=server.headers,
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert _wait(lambda: metric(scrape(server.url), "specserve_requests_running") == 1)
    # the client has gone: within a step the worker drops the sequence and its KV slot
    assert _wait(lambda: metric(scrape(server.url), "specserve_requests_running") == 0)
    s = scrape(server.url)
    assert metric(s, "specserve_kv_cache_usage_ratio") == 0.0
    assert _wait(lambda: metric(scrape(server.url), "specserve_requests_total", outcome="aborted") == aborted + 1)
    assert wait_balanced(server.url)


def test_disconnect_non_streaming_aborts(server):
    assert wait_balanced(server.url)
    body = {**LONG, "stream": False}
    try:
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=1.5)
    except httpx.TimeoutException:
        pass
    assert _wait(lambda: metric(scrape(server.url), "specserve_requests_running") == 0)
    assert wait_balanced(server.url)


def test_worker_death_fails_in_flight_and_exits_nonzero(make_server):
    s = make_server()
    pid = s.worker_pid()
    events = []
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=LONG, headers=s.headers, timeout=60) as r:
        lines = r.iter_lines()
        events.append(next(lines))
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for line in lines:
            if line:
                events.append(line)
        ended_after = time.monotonic() - t0
    assert ended_after < 10
    assert '"error"' in events[-1] and events[-1] != "data: [DONE]"

    def health_down():
        try:
            return httpx.get(s.url + "/health", timeout=2).status_code == 503
        except httpx.HTTPError:
            return True  # already exited
    assert _wait(health_down, timeout=10)
    s.proc.wait(timeout=60)
    assert s.proc.returncode not in (0, None)


def test_sigterm_drains_in_flight_and_exits_zero(make_server):
    s = make_server(drain_timeout=90.0)  # generous: a loaded CI machine may decode slowly
    body = {**LONG, "max_tokens": 16}
    result = {}

    def stream():
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, headers=s.headers, timeout=120) as r:
            result["lines"] = [line for line in r.iter_lines() if line]

    t = threading.Thread(target=stream)
    t.start()
    assert _wait(lambda: metric(scrape(s.url), "specserve_requests_running") == 1)
    s.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert result["lines"][-1] == "data: [DONE]"  # the in-flight request finished
    assert s.proc.wait(timeout=60) == 0
