"""The API process <-> worker pipe under load: a burst of long prompts (more bytes than the pipe buffers) must not
stall the API's event loop, nor keep the health probe waiting behind prefills.

The latency bounds are in units of this machine's own step time, measured on the same server around the probing: a
probe may take less than half of one long prefill step, where a probe answered only between two steps waits up to a
whole one (a loaded CPU slows the steps and the probes alike)."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
import uuid

import httpx
import pytest

from tests.server.conftest import ServerProcess, metric, scrape, wait_balanced

pytestmark = pytest.mark.server

MODEL = "SmolLM2-135M-Instruct"
BURST = 64
PROMPT_LEN = 1500  # ids in [1000, 49000): 3 msgpack bytes each, so 64 prompts are ~290 KB, over the ~200 KB a
# socketpair buffers; and one such prefill takes a second or more on a small CPU


@pytest.fixture(scope="module")
def burst_server(tmp_path_factory, target32):
    # Whole prompts in one step: the automatic step budget cuts a prefill into chunks of a few decode steps' cost
    # (~0.1 s here), too short to tell a probe answered at once from one that waited for the step.
    s = ServerProcess(tmp_path_factory.mktemp("ipc"), num_slots=2, max_waiting=BURST, max_seq_len=2048,
                      server_options={"max_step_tokens": 2 * PROMPT_LEN})
    try:
        yield s.wait_ready()
    finally:
        s.stop()


class Burst:
    """`n` streaming completions with long token-id prompts, sent at once from a thread of their own; `cancel()`
    closes every connection (the server aborts them)."""

    def __init__(self, server: ServerProcess, n: int = BURST, prompt_len: int = PROMPT_LEN):
        rng = random.Random(0)
        salt = uuid.uuid4().hex  # a fresh prefix-cache namespace: no prompt of an earlier burst is cached
        self.bodies = [{"model": MODEL, "prompt": [rng.randrange(1000, 49000) for _ in range(prompt_len)],
                        "max_tokens": 8, "stream": True, "cache_salt": salt} for _ in range(n)]
        self.server = server
        self.statuses: list[int] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),), daemon=True)
        self.tasks: list[asyncio.Task] = []

    def start(self) -> "Burst":
        self.thread.start()
        return self

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=len(self.bodies) + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            self.tasks = [asyncio.ensure_future(self._one(client, b)) for b in self.bodies]
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _one(self, client: httpx.AsyncClient, body: dict) -> None:
        async with client.stream("POST", self.server.url + "/v1/completions", json=body,
                                 headers=self.server.headers) as r:
            self.statuses.append(r.status_code)  # the response starts once the request went to the worker
            async for _ in r.aiter_lines():
                pass

    @property
    def submitted(self) -> int:
        return sum(1 for s in self.statuses if s == 200)

    def cancel(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in self.tasks])
        self.thread.join(60)


def prefill_seconds(server: ServerProcess, repeats: int = 2) -> float:
    """This machine's step time now: the wall time of a one-token completion of a PROMPT_LEN prompt (one prefill
    step) on the idle server, the slowest of ``repeats``."""
    rng = random.Random(1)
    times = []
    for _ in range(repeats):
        # a fresh cache namespace each time: the same prompts measured again would hit the prefix cache and time
        # one token, not a prefill
        body = {"model": MODEL, "prompt": [rng.randrange(1000, 49000) for _ in range(PROMPT_LEN)], "max_tokens": 1,
                "cache_salt": uuid.uuid4().hex}
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=300)
        assert r.status_code == 200, r.text
        times.append(time.monotonic() - t0)
    return max(times)


def _probe_while(burst: Burst, url: str, headers: dict | None = None, after_submitted_s: float = 4.0,
                 max_probes: int = 100, max_s: float = 30.0) -> list[float]:
    """GET `url` back to back while the burst is in flight; the latency of each probe (a failed or non-200 probe
    counts as infinitely slow). Goes on `after_submitted_s` seconds after every request was submitted (the worker
    is then busy with prefills, one after the other), within bounds on count and time."""
    latencies: list[float] = []
    submitted_at = None
    t_end = time.monotonic() + max_s
    while len(latencies) < max_probes and time.monotonic() < t_end:
        if submitted_at is None and burst.submitted == len(burst.bodies):
            submitted_at = time.monotonic()
        if submitted_at is not None and time.monotonic() - submitted_at > after_submitted_s:
            break
        t0 = time.monotonic()
        try:
            ok = httpx.get(url, headers=headers, timeout=10).status_code == 200
        except httpx.HTTPError:
            ok = False
        latencies.append(time.monotonic() - t0 if ok else float("inf"))
        time.sleep(0.1)
    return latencies


def test_health_answers_within_half_a_step_during_a_burst_of_long_prompts(burst_server):
    s = burst_server
    assert wait_balanced(s.url, 30)
    step_s = prefill_seconds(s)
    burst = Burst(s).start()
    try:
        latencies = _probe_while(burst, s.url + "/health")
        busy = metric(scrape(s.url), "specserve_requests_waiting")
    finally:
        burst.cancel()
    assert wait_balanced(s.url, 60)  # the cancelled burst is aborted: nothing left running or waiting
    step_s = max(step_s, prefill_seconds(s))  # the step time before and after the probing, the slower
    # the worker's reader thread answers a probe mid-step; answered between steps, one would wait ~ a whole step
    assert max(latencies) < step_s / 2, (f"step {step_s:.2f} s", [round(x, 2) for x in latencies])
    assert burst.submitted == BURST, burst.statuses  # the whole burst went through the pipe while we probed
    assert busy > 0  # and was still queued at the end of the probing: the worker was busy all along


def test_a_frozen_worker_does_not_freeze_the_api(burst_server):
    """The worker stops reading (SIGSTOP: a hung accelerator, a debugger): the API keeps serving while the burst
    queues up more bytes than the pipe holds, and everything drains once the worker runs again."""
    s = burst_server
    assert wait_balanced(s.url, 30)
    step_s = prefill_seconds(s)
    pid = s.worker_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        burst = Burst(s).start()
        try:
            latencies = _probe_while(burst, s.url + "/v1/models", s.headers, after_submitted_s=2.0, max_s=20.0)
        finally:
            burst.cancel()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_balanced(s.url, 60)
    step_s = max(step_s, prefill_seconds(s))
    # an event loop that blocked on the full pipe would answer nothing until the worker ran again (a probe timing
    # out after 10 s counts as infinitely slow); a free one answers far within a step
    assert max(latencies) < step_s / 2, (f"step {step_s:.2f} s", [round(x, 2) for x in latencies])
    assert burst.submitted == BURST, burst.statuses
    assert httpx.get(s.url + "/health", timeout=15).status_code == 200
