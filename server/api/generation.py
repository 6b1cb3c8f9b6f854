"""One request's life in the API process: submit token ids to the worker, turn the tokens that come back into
UTF-8-safe text deltas, cut at stop strings, and keep the request's metrics.

`Generation.deltas()` yields `Delta`s; the routes shape them into OpenAI responses or SSE chunks. Whatever ends the
iteration (finish, stop string, client disconnect, error), the worker hears an abort if it still holds the request.
A stop string ends the request before the worker does: the text goes out at once, and `usage()` then waits (briefly)
for the worker's answer to the abort, which carries the request's speculative stats.
"""
from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from server.api.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.api.errors import APIError
from server.metrics import Metrics
from server.worker import messages as m
from server.worker.process import WorkerClient, WorkerDied, new_request_id

# How long usage waits for the stats of a request cut by a stop string: the worker answers the abort before its
# next engine call, so within one step or prefill.
FINAL_STATS_TIMEOUT_S = 5.0
SPEC_USAGE_KEYS = ("drafter", "draft_tokens", "accepted_tokens", "verify_steps", "mean_accepted_length",
                   "mean_draft_length", "max_draft_length")


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None


@dataclass
class Generation:
    worker: WorkerClient
    tokenizer: object
    metrics: Metrics
    prompt_ids: list[int]
    sampling: dict            # from protocol.sampling_from; max_tokens already resolved to an int
    stop_token_ids: list[int]
    request_id: str = field(default_factory=lambda: new_request_id("req"))
    completion_tokens: int = 0  # tokens whose text the reply returned (up to the one that completed a stop string)
    finish_reason: str | None = None
    spec_usage: dict | None = None
    _done: bool = False          # the worker no longer holds the request (or has been told to drop it)
    _stats_pending: bool = False  # stopped early: the worker's answer to the abort has the stats

    def submit(self) -> None:
        """Hand the request to the worker (raises APIError 503 when the worker is gone)."""
        s = self.sampling
        req = m.Generate(self.request_id, self.prompt_ids, s["max_tokens"], s["temperature"], s["top_p"],
                         s["top_k"], s["seed"], self.stop_token_ids)
        self.t0 = time.perf_counter()
        try:
            self.queue = self.worker.submit(req)
        except WorkerDied:
            self._done = True
            raise APIError(503, "the model worker is not running", "server_error", None, "worker_unavailable")
        self.metrics.prompt_tokens.labels(**self.metrics.labels).inc(len(self.prompt_ids))

    def _count_tokens(self, n: int, last: float | None) -> float:
        """Token metrics for `n` tokens that arrived now; returns the arrival time."""
        mt, lb = self.metrics, self.metrics.labels
        now = time.perf_counter()
        if last is None:
            mt.ttft.labels(**lb).observe(now - self.t0)
            for _ in range(n - 1):  # tokens that arrived with the first one cost nothing extra
                mt.itl.labels(**lb).observe(0.0)
        else:
            for _ in range(n):
                mt.itl.labels(**lb).observe((now - last) / n)
        mt.generation_tokens.labels(**lb).inc(n)
        return now

    async def deltas(self) -> AsyncIterator[Delta]:
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopStringMatcher(self.sampling.get("stop") or [])
        ends: list[int] = []  # ends[i]: characters of text once token i (or its message, without stops) was decoded
        last = None
        try:
            while True:
                msg = await self.queue.get()
                if isinstance(msg, m.Failed):
                    self._done = True
                    raise _failure(msg)
                if msg.token_ids:
                    last = self._count_tokens(len(msg.token_ids), last)
                text = ""
                # one token at a time where a stop string must be located to its token; else one decode per message
                for group in ([[t] for t in msg.token_ids] if stops.stops else [msg.token_ids]):
                    if group:
                        piece = detok.add(group)
                        text += piece
                        ends.extend([(ends[-1] if ends else 0) + len(piece)] * len(group))
                if msg.finish_reason:
                    self._done = True
                    self.spec_usage = msg.usage
                    tail = detok.finish()
                    text += tail
                    if ends:
                        ends[-1] += len(tail)
                out, stopped = stops.feed(text)
                if stopped:
                    self._stopped_early(stops.end, ends)
                    yield Delta(out, "stop")
                    return
                if msg.finish_reason:
                    tail = stops.finish()  # may still complete a stop string that was waiting on a longer one
                    if stops.stopped:
                        self._stopped_early(stops.end, ends)
                    else:
                        self.completion_tokens = len(ends)
                        self.finish_reason = msg.finish_reason
                    yield Delta(out + tail, self.finish_reason)
                    return
                if out:
                    yield Delta(out)
        finally:
            self.metrics.e2e.labels(**self.metrics.labels).observe(time.perf_counter() - self.t0)
            if not self._done:
                self._done = True
                self.worker.abort(self.request_id)

    def _stopped_early(self, stop_end: int, ends: list[int]) -> None:
        """A stop string ending at character `stop_end` ended the request: count the tokens up to the one that
        completed it, and ask the worker to drop the request and send its stats (unless it already finished)."""
        self.finish_reason = "stop"
        self.completion_tokens = min(bisect.bisect_left(ends, stop_end) + 1, len(ends))
        if not self._done:
            self._done = True
            self._stats_pending = True
            self.worker.abort(self.request_id, final=True)

    async def _final_stats(self) -> None:
        """The stats of a request stopped early: from the worker's answer to the abort, or from its finishing
        message if it finished first. Tokens it generated past the stop are not part of the reply."""
        while True:
            msg = await self.queue.get()
            if isinstance(msg, m.Aborted) or (isinstance(msg, m.Tokens) and msg.finish_reason):
                self.spec_usage = msg.usage
                return
            if isinstance(msg, m.Failed):  # the worker died: no stats
                return

    async def usage(self) -> dict:
        """The OpenAI usage, with the speculative stats (call once the deltas are done)."""
        if self._stats_pending:
            self._stats_pending = False
            try:
                await asyncio.wait_for(self._final_stats(), FINAL_STATS_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
        u = {"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.completion_tokens,
             "total_tokens": len(self.prompt_ids) + self.completion_tokens}
        if self.spec_usage:
            u.update({k: self.spec_usage.get(k) for k in SPEC_USAGE_KEYS})
        return u


def _failure(msg: m.Failed) -> APIError:
    if msg.kind == "overloaded":
        return APIError(503, "the server is overloaded: the waiting queue is full; retry later", "server_error",
                        None, "queue_full", headers={"Retry-After": "1"})
    if msg.kind == "server_error":
        return APIError(500, msg.message, "server_error", None, "internal_error")
    return APIError(400, msg.message, "invalid_request_error", None, None)
