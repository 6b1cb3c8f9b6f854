"""The worker's scheduler: a bounded waiting queue, one running sequence per KV slot, interleaved steps.

Each loop iteration reads every pending message, admits waiting requests while slots are free (admission runs the
prefill and emits the first token), then gives every running sequence one speculative step, reading messages again
between steps so an abort frees its slot within one step. Single-sequence steps keep the engine simple and
latency-first; all running sequences make progress, so concurrent streams all receive tokens.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

from core.sampling import SamplingParams
from server.engine.engine import Engine, RequestError, Sequence
from server.worker import messages as m

log = logging.getLogger("specserve.worker")


class Scheduler:
    def __init__(self, engine: Engine, send: Callable[[m.FromWorker], None], max_waiting: int):
        self.engine, self.send, self.max_waiting = engine, send, max_waiting
        self.waiting: OrderedDict[str, m.Generate] = OrderedDict()
        self.running: OrderedDict[str, Sequence] = OrderedDict()
        self.stopping = False
        self._last_status: tuple | None = None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def handle(self, msg: m.ToWorker) -> None:
        if isinstance(msg, m.Generate):
            if msg.request_id in self.waiting or msg.request_id in self.running:
                self.send(m.Failed(msg.request_id, "duplicate request id"))
            elif len(self.waiting) >= self.max_waiting + max(0, self.engine.pool.num_slots - len(self.running)):
                self.send(m.Failed(msg.request_id, "the waiting queue is full", kind="overloaded"))
            else:
                self.waiting[msg.request_id] = msg
        elif isinstance(msg, m.Abort):
            self.waiting.pop(msg.request_id, None)
            seq = self.running.pop(msg.request_id, None)
            if seq is not None:
                self.engine.release(seq)
        elif isinstance(msg, m.Ping):
            self.send(m.Pong(msg.request_id))
        elif isinstance(msg, m.Shutdown):
            self.stopping = True

    def admit(self) -> None:
        pool = self.engine.pool
        while self.waiting and pool.slots_used < pool.num_slots:
            rid, req = self.waiting.popitem(last=False)
            try:
                sp = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed)
                seq = self.engine.add(req.prompt_ids, sp, req.max_tokens, req.stop_token_ids)
            except (RequestError, ValueError) as e:
                self.send(m.Failed(rid, str(e)))
                continue
            self.running[rid] = seq
            self._run(rid, seq, self.engine.prefill, prefill=True)

    def step_all(self, poll: Callable[[], None]) -> None:
        """One step for every running sequence; `poll` handles messages that arrived in between."""
        for rid in list(self.running):
            poll()
            seq = self.running.get(rid)
            if seq is not None:  # may have been aborted by the message just handled
                self._run(rid, seq, self.engine.step, prefill=False)

    def _run(self, rid: str, seq: Sequence, fn, prefill: bool) -> None:
        before_draft, before_acc = seq.stats.draft_tokens, seq.stats.accepted_tokens
        try:
            tokens = fn(seq)
        except Exception as e:  # an engine fault fails this request, not the worker
            log.exception("request %s failed in the engine", rid)
            self.running.pop(rid, None)
            self.engine.release(seq)
            self.send(m.Failed(rid, f"engine error: {type(e).__name__}: {e}", kind="server_error"))
            return
        steps = [] if prefill else [m.StepStats(seq.stats.draft_tokens - before_draft,
                                                seq.stats.accepted_tokens - before_acc)]
        usage = None
        if seq.finish_reason is not None:
            self.running.pop(rid, None)
            self.engine.release(seq)
            usage = {"drafter": self.engine.drafter.name, **seq.stats.as_dict()}
        self.send(m.Tokens(rid, tokens, steps, seq.finish_reason, usage))

    def status(self) -> None:
        """Send the gauges when they changed."""
        now = (len(self.running), len(self.waiting), round(self.engine.pool.usage(), 4))
        if now != self._last_status:
            self._last_status = now
            self.send(m.Status(*now))
