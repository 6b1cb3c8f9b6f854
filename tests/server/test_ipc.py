"""The API process <-> worker pipe under load: a burst of long prompts (more bytes than the pipe buffers) must not
stall the API's event loop, nor keep the health probe waiting behind a step.

Nothing here is timed. The worker is held inside one step by a test hook (``server.engine.faults``: a request with
token HOLD blocks the step's forward until the test releases it), or frozen outright (SIGSTOP), and the checks are
what must happen meanwhile: probes answered while the worker is provably inside the step, or not running at all. A
worker that read the pipe only between steps, or an API that wrote to the pipe from its event loop, would answer no
probe until the step ends: the probes would time out (10 s each) and fail."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import uuid

import httpx
import pytest

from tests.server.conftest import ServerProcess, wait_balanced, wait_until

pytestmark = pytest.mark.server

MODEL = "SmolLM2-135M-Instruct"
BURST = 64
PROMPT_LEN = 1500  # ids in [1000, 49000): 3 msgpack bytes each, so 64 prompts are ~290 KB, over the ~200 KB a
# socketpair buffers
HOLD = 999  # a prompt with this token holds the step's forward until released (never in the burst's prompts)
PROBES = 5


@pytest.fixture(scope="module")
def burst_server(tmp_path_factory, target32):
    hold_dir = tmp_path_factory.mktemp("hold")
    s = ServerProcess(tmp_path_factory.mktemp("ipc"), num_slots=2, max_waiting=BURST, max_seq_len=2048,
                      env={"SPECSERVE_INJECT_FAULTS": f"{HOLD}=forward:hold", "SPECSERVE_FAULT_HOLD_DIR": str(hold_dir)})
    s.hold_dir = hold_dir
    try:
        yield s.wait_ready()
    finally:
        (hold_dir / "release").touch()  # never leave the worker held
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


def _probes(url: str, headers: dict | None = None) -> list[int]:
    """The status of PROBES GETs of ``url``, one after the other (0: no answer within 10 s)."""
    out = []
    for _ in range(PROBES):
        try:
            out.append(httpx.get(url, headers=headers, timeout=10).status_code)
        except httpx.HTTPError:
            out.append(0)
    return out


def test_health_answers_while_a_step_runs_during_a_burst_of_long_prompts(burst_server):
    s = burst_server
    assert wait_balanced(s.url, 30)
    held, release = s.hold_dir / "held", s.hold_dir / "release"
    body = {"model": MODEL, "prompt": [HOLD, 7, 8, 9], "max_tokens": 2, "cache_salt": uuid.uuid4().hex}
    holder = threading.Thread(target=lambda: setattr(s, "held_reply", httpx.post(
        s.url + "/v1/completions", json=body, headers=s.headers, timeout=300)), daemon=True)
    holder.start()
    try:
        assert wait_until(held.exists, 120), "the worker never entered the held step"
        burst = Burst(s).start()
        try:
            assert wait_until(lambda: burst.submitted == BURST, 60), burst.statuses  # all through the pipe
            statuses = _probes(s.url + "/health")
            assert held.exists() and not release.exists()  # the worker was inside the step all along
        finally:
            release.touch()
            holder.join(120)
            burst.cancel()
    finally:
        release.touch()
    # the worker's reader thread answers a probe mid-step, past the burst's bytes in the pipe
    assert statuses == [200] * PROBES
    assert s.held_reply.status_code == 200 and s.held_reply.json()["usage"]["completion_tokens"] == 2
    assert wait_balanced(s.url, 120)  # the cancelled burst is aborted: nothing left running or waiting


def test_a_frozen_worker_does_not_freeze_the_api(burst_server):
    """The worker stops reading (SIGSTOP: a hung accelerator, a debugger): the API keeps serving while the burst
    queues up more bytes than the pipe holds, and everything drains once the worker runs again."""
    s = burst_server
    assert wait_balanced(s.url, 30)
    pid = s.worker_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        burst = Burst(s).start()
        try:
            assert wait_until(lambda: burst.submitted == BURST, 60), burst.statuses
            statuses = _probes(s.url + "/v1/models", s.headers)
        finally:
            burst.cancel()
    finally:
        os.kill(pid, signal.SIGCONT)
    # an event loop that blocked on the full pipe would answer nothing until the worker ran again
    assert statuses == [200] * PROBES
    assert wait_balanced(s.url, 120)
    assert httpx.get(s.url + "/health", timeout=15).status_code == 200
