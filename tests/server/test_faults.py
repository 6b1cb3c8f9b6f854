"""Faults: client disconnects, worker death, SIGTERM drain."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import metric, scrape, wait_balanced, wait_until

pytestmark = pytest.mark.server

# No max_tokens and ignore_eos: the request runs to the context end (~480 tokens, many seconds on a CPU); it cannot
# end by itself within the bounds below.
LONG = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Write a very long essay."}],
        "stream": True, "ignore_eos": True}
# The worker reads messages before every step, so an abort frees the slot once the step in progress ends. A step
# takes tens of ms to a second or two on a small, busy CPU, so "within one step" is checked by counting verify steps
# (load-independent), under a time bound well below the many seconds the request would need to end by itself.
FREE_BOUND_S = 6.0


def _running(url) -> float:
    return metric(scrape(url), "specserve_requests_running")


def _verify_steps(url) -> float:
    return metric(scrape(url), "specserve_spec_verify_steps_total")


def _a_few_steps_in(url, steps: int = 3) -> None:
    """Wait until the worker ran ``steps`` more verify steps (the running request is well into its generation)."""
    start = _verify_steps(url)
    assert wait_until(lambda: _verify_steps(url) >= start + steps, timeout=60, step=0.02)


def assert_freed_within_one_step(url, steps_at_close: float) -> None:
    """The client just went away: its slot is free before the worker starts another step for it."""
    t0 = time.monotonic()
    assert wait_until(lambda: _running(url) == 0, timeout=FREE_BOUND_S, step=0.02), "the slot was not freed"
    freed_after = time.monotonic() - t0
    # the step running at the close, plus one whose message may have been in the pipe when we scraped
    more = _verify_steps(url) - steps_at_close
    assert more <= 2, (more, freed_after)
    assert metric(scrape(url), "specserve_kv_cache_usage_ratio") == 0.0


def test_disconnect_mid_stream_frees_the_slot(server):
    assert wait_balanced(server.url)
    before = scrape(server.url)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=LONG, headers=server.headers,
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert wait_until(lambda: _running(server.url) == 1)
        _a_few_steps_in(server.url)
    # the client has gone: within a step the worker drops the sequence and its KV slot
    assert_freed_within_one_step(server.url, _verify_steps(server.url))
    s = scrape(server.url)
    generated = metric(s, "specserve_generation_tokens_total") - metric(before, "specserve_generation_tokens_total")
    assert generated < 400  # it was cut short, far from the context end
    assert wait_until(lambda: metric(scrape(server.url), "specserve_requests_total", outcome="aborted") ==
                 metric(before, "specserve_requests_total", outcome="aborted") + 1)
    assert wait_balanced(server.url)


def test_disconnect_non_streaming_aborts(server):
    assert wait_balanced(server.url)
    before = scrape(server.url)
    body = json.dumps({**LONG, "stream": False}).encode()
    host, port = server.url.rsplit("/", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        assert wait_until(lambda: _running(server.url) == 1)
        _a_few_steps_in(server.url)
    finally:
        sock.close()  # the client gives up waiting for the JSON reply
    assert_freed_within_one_step(server.url, _verify_steps(server.url))
    s = scrape(server.url)
    generated = metric(s, "specserve_generation_tokens_total") - metric(before, "specserve_generation_tokens_total")
    assert generated < 400
    assert wait_until(lambda: metric(scrape(server.url), "specserve_requests_total", outcome="aborted") ==
                 metric(before, "specserve_requests_total", outcome="aborted") + 1)
    assert wait_balanced(server.url)


def test_worker_death_past_the_restart_budget_fails_in_flight_and_exits_nonzero(make_server):
    """With no restart allowed (`server.worker_restarts: 0`) a dead worker ends the server, for its supervisor to
    restart (restarts within the budget: tests/server/test_resilience.py)."""
    s = make_server(server_options={"worker_restarts": 0})
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
    assert wait_until(health_down, timeout=10)
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
    assert wait_until(lambda: metric(scrape(s.url), "specserve_requests_running") == 1)
    s.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert result["lines"][-1] == "data: [DONE]"  # the in-flight request finished
    assert s.proc.wait(timeout=60) == 0
