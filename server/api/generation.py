"""One request's life in the API process: submit token ids to the worker, turn the tokens that come back into
UTF-8-safe text deltas, cut at stop strings, and keep the request's metrics.

`Generation.deltas()` yields `Delta`s; the routes shape them into OpenAI responses or SSE chunks. Whatever ends the
iteration (finish, stop string, client disconnect, error), the worker hears an abort if it still holds the request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from server.api.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.api.errors import APIError
from server.metrics import Metrics
from server.worker import messages as m
from server.worker.process import WorkerClient, WorkerDied, new_request_id


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
    completion_tokens: int = 0
    finish_reason: str | None = None
    spec_usage: dict | None = None
    _done: bool = False

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

    async def deltas(self) -> AsyncIterator[Delta]:
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopStringMatcher(self.sampling.get("stop") or [])
        mt, lb = self.metrics, self.metrics.labels
        last = None
        try:
            while True:
                msg = await self.queue.get()
                if isinstance(msg, m.Failed):
                    self._done = True
                    raise _failure(msg)
                now = time.perf_counter()
                n = len(msg.token_ids)
                if n:
                    if last is None:
                        mt.ttft.labels(**lb).observe(now - self.t0)
                        for _ in range(n - 1):  # tokens that arrived with the first one cost nothing extra
                            mt.itl.labels(**lb).observe(0.0)
                    else:
                        for _ in range(n):
                            mt.itl.labels(**lb).observe((now - last) / n)
                    last = now
                    self.completion_tokens += n
                    mt.generation_tokens.labels(**lb).inc(n)
                text = detok.add(msg.token_ids)
                if msg.finish_reason:
                    self._done = True
                    self.spec_usage = msg.usage
                    text += detok.finish()
                out, stopped = stops.feed(text)
                if stopped:
                    self.finish_reason = "stop"
                    yield Delta(out, "stop")
                    return
                if msg.finish_reason:
                    tail = stops.finish()  # may still complete a stop string that was waiting on a longer one
                    self.finish_reason = "stop" if stops.stopped else msg.finish_reason
                    yield Delta(out + tail, self.finish_reason)
                    return
                if out:
                    yield Delta(out)
        finally:
            mt.e2e.labels(**lb).observe(time.perf_counter() - self.t0)
            if not self._done:
                self._done = True
                self.worker.abort(self.request_id)

    def usage(self) -> dict:
        u = {"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.completion_tokens,
             "total_tokens": len(self.prompt_ids) + self.completion_tokens}
        if self.spec_usage:
            u.update({k: self.spec_usage.get(k) for k in ("drafter", "draft_tokens", "accepted_tokens",
                                                            "verify_steps", "mean_accepted_length")})
        return u


def _failure(msg: m.Failed) -> APIError:
    if msg.kind == "overloaded":
        return APIError(503, "the server is overloaded: the waiting queue is full; retry later", "server_error",
                        None, "queue_full", headers={"Retry-After": "1"})
    if msg.kind == "server_error":
        return APIError(500, msg.message, "server_error", None, "internal_error")
    return APIError(400, msg.message, "invalid_request_error", None, None)
