"""The worker's scheduler: a bounded waiting queue, one running sequence per KV slot, one batched step at a time.

Each iteration (``tick``) admits waiting requests while KV slots are free, then runs ONE target forward over every
running sequence: a speculative step (its draft tree, sized by the load-aware ``DraftBudget``) for each sequence whose
prompt is cached, and prompt chunks of the admitted ones, filling the per-step token budget
(``server.max_step_tokens``) after one row per decoding sequence; draft rows come on top. A long prompt is so
prefilled over several steps while the other streams keep receiving tokens; its first token streams when its last
chunk is done. Messages are read between two iterations, so an abort frees its slot within one step. ``busy_s()``
tells the worker's reader thread (health probes) how long the current engine call has run.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable

from core.sampling import SamplingParams
from server.engine.engine import Engine, RequestError, Sequence
from server.worker import messages as m
from server.worker.budget import DraftBudget

log = logging.getLogger("specserve.worker")

MIN_PREFILL_CHUNK = 16  # prompt tokens a step prefills even when the decoding sequences fill the budget


class Scheduler:
    def __init__(self, engine: Engine, send: Callable[[m.FromWorker], None], max_waiting: int,
                 max_step_tokens: int | Callable[[int], int] = 256, budget: DraftBudget | None = None):
        self.engine, self.send, self.max_waiting = engine, send, max_waiting
        self.max_step_tokens = max_step_tokens  # rows per step, or a function of the step's tree rows giving them
        self.budget = budget or DraftBudget.fixed()
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
                self.budget.forget(seq)
                self.send(m.Aborted(msg.request_id, self._usage(seq)))
            elif req is not None:
                self.send(m.Aborted(msg.request_id, None))
        elif isinstance(msg, m.Shutdown):
            self.stopping = True

    def admit(self) -> None:
        """Give waiting requests free KV slots; their prompts are prefilled by the following steps."""
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

    def tick(self) -> None:
        """Admit, then one batched step: every decoding sequence steps, prompt chunks fill the rest of the budget."""
        self.admit()
        decoding = {rid: s for rid, s in self.running.items() if s.cache_len >= s.prompt_len}
        # Prompt chunks are sized as for a plain step (one row per decoding sequence); draft rows come on top, where
        # the budget finds they pay with the chunks in the step. Drafts that took the chunks' rows instead starved
        # the prompts under load (TTFT doubled at 64 streams of code prompts).
        limit = self.max_step_tokens(len(decoding)) if callable(self.max_step_tokens) else self.max_step_tokens
        room = limit - len(decoding)
        chunks = {}
        for rid, seq in self.running.items():
            if rid in decoding:
                continue
            n = min(seq.prompt_len - seq.cache_len, max(room, MIN_PREFILL_CHUNK))
            if n < 1 or (chunks and room < 1):
                break
            chunks[rid] = n
            room -= n
        if not decoding and not chunks:
            return
        max_rows = self.budget.plan(list(decoding.values()), fixed_rows=sum(chunks.values()))
        batch = {**decoding, **{rid: self.running[rid] for rid in chunks}}
        before = {rid: (s.stats.draft_tokens, s.stats.accepted_tokens, s.stats.draft_seconds)
                  for rid, s in decoding.items()}
        self._busy_since = started = time.monotonic()
        try:
            emitted = self.engine.run(list(decoding.values()), [(self.running[rid], n) for rid, n in chunks.items()],
                                      max_rows)
        except Exception as e:  # an engine fault fails the requests of this step, not the worker
            log.exception("a step of %d requests failed in the engine", len(batch))
            for rid, seq in batch.items():
                self.running.pop(rid, None)
                self.engine.release(seq)
                self.send(m.Failed(rid, f"engine error: {type(e).__name__}: {e}", kind="server_error"))
            return
        finally:
            self._busy_since = None
        seconds = time.monotonic() - started
        step = {rid: (s.stats.draft_tokens - before[rid][0], s.stats.accepted_tokens - before[rid][1],
                      s.stats.draft_seconds - before[rid][2]) for rid, s in decoding.items()}  # this step's share
        drafted = sum(d for d, _, _ in step.values())
        rows = len(decoding) + drafted + sum(chunks.values())
        self.send(m.Step(len(decoding), rows, drafted, sum(chunks.values()), seconds))
        self.budget.record_step(1000 * seconds, rows, len(decoding), sum(r > 1 for r in max_rows.values()),
                                1000 * sum(p for _, _, p in step.values()),
                                tokens=sum(len(emitted.get(s.seq_id, ())) for s in decoding.values()),
                                prefill_rows=sum(chunks.values()))
        for rid, (d, a, _) in step.items():
            self.budget.record(decoding[rid].seq_id, d, a, max_rows[decoding[rid].seq_id])
        for rid, seq in batch.items():
            tokens = emitted.get(seq.seq_id, [])
            if rid in chunks and not tokens and seq.finish_reason is None:
                continue  # a prompt chunk that is not the last: nothing to tell yet
            steps = [m.StepStats(*step[rid][:2])] if rid in step else []
            usage = None
            if seq.finish_reason is not None:
                self.running.pop(rid, None)
                self.engine.release(seq)
                self.budget.forget(seq)
                usage = self._usage(seq)
            self.send(m.Tokens(rid, tokens, steps, seq.finish_reason, usage))

    def status(self) -> None:
        """Send the gauges when they changed."""
        now = (len(self.running), len(self.waiting), round(self.engine.pool.usage(), 4))
        if now != self._last_status:
            self._last_status = now
            self.send(m.Status(*now))
