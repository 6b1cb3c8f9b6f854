"""The worker's scheduler: a bounded waiting queue, one running sequence per KV slot, interleaved steps.

Each loop iteration reads every pending message, admits waiting requests while slots are free (admission runs the
prefill and emits the first token), then gives every running sequence one speculative step, reading messages again
between two prefills and between two steps, so an abort frees its slot within one step (or prefill). Single-sequence
steps keep the engine simple and latency-first; all running sequences make progress, so concurrent streams all
receive tokens. `busy_s()` tells the worker's reader thread (health probes) how long the current engine call has run.
"""
from __future__ import annotations

import logging
import time
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
        self._busy_since: float | None = None  # monotonic start of the engine call in progress

    def busy_s(self) -> float:
        """Seconds the engine call in progress (a prefill or a step) has run; 0 between two. Safe from any thread."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _usage(self, seq: Sequence) -> dict:
        return {"drafter": self.engine.drafter.name, **seq.stats.as_dict()}

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def handle(self, msg: m.Generate | m.Abort | m.Shutdown) -> None:
        """One message from the API process (health probes never get here: the worker's reader thread answers them)."""
        if isinstance(msg, m.Generate):
            if msg.request_id in self.waiting or msg.request_id in self.running:
                self.send(m.Failed(msg.request_id, "duplicate request id"))
            elif len(self.waiting) >= self.max_waiting + max(0, self.engine.pool.num_slots - len(self.running)):
                self.send(m.Failed(msg.request_id, "the waiting queue is full", kind="overloaded"))
            else:
                self.waiting[msg.request_id] = msg
        elif isinstance(msg, m.Abort):
            req = self.waiting.pop(msg.request_id, None)
            seq = self.running.pop(msg.request_id, None)
            if seq is not None:
                self.engine.release(seq)
                self.send(m.Aborted(msg.request_id, self._usage(seq)))
            elif req is not None:
                self.send(m.Aborted(msg.request_id, None))
        elif isinstance(msg, m.Shutdown):
            self.stopping = True

    def admit(self, poll: Callable[[], None] = lambda: None) -> None:
        """Prefill waiting requests while slots are free; `poll` handles messages that arrived during a prefill."""
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
            poll()

    def step_all(self, poll: Callable[[], None]) -> None:
        """One step for every running sequence; `poll` handles messages that arrived in between."""
        for rid in list(self.running):
            poll()
            seq = self.running.get(rid)
            if seq is not None:  # may have been aborted by the message just handled
                self._run(rid, seq, self.engine.step, prefill=False)

    def _run(self, rid: str, seq: Sequence, fn, prefill: bool) -> None:
        before_draft, before_acc = seq.stats.draft_tokens, seq.stats.accepted_tokens
        self._busy_since = time.monotonic()
        try:
            tokens = fn(seq)
        except Exception as e:  # an engine fault fails this request, not the worker
            log.exception("request %s failed in the engine", rid)
            self.running.pop(rid, None)
            self.engine.release(seq)
            self.send(m.Failed(rid, f"engine error: {type(e).__name__}: {e}", kind="server_error"))
            return
        finally:
            self._busy_since = None
        steps = [] if prefill else [m.StepStats(seq.stats.draft_tokens - before_draft,
                                                seq.stats.accepted_tokens - before_acc)]
        usage = None
        if seq.finish_reason is not None:
            self.running.pop(rid, None)
            self.engine.release(seq)
            usage = self._usage(seq)
        self.send(m.Tokens(rid, tokens, steps, seq.finish_reason, usage))

    def status(self) -> None:
        """Send the gauges when they changed."""
        now = (len(self.running), len(self.waiting), round(self.engine.pool.usage(), 4))
        if now != self._last_status:
            self._last_status = now
            self.send(m.Status(*now))
