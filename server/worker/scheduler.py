"""The worker's scheduler: a bounded waiting queue, one running sequence per KV slot, one batched step at a time.

Each iteration (``tick``) admits waiting requests while KV slots are free, then runs ONE target forward over every
running sequence: a speculative step (its draft tree, sized by the load-aware ``DraftBudget``) for each sequence whose
prompt is cached, and prompt chunks of the admitted ones, filling the per-step token budget
(``server.max_step_tokens``) after one row per decoding sequence; draft rows come on top. A long prompt is so
prefilled over several steps while the other streams keep receiving tokens; its first token streams when its last
chunk is done. Messages are read between two iterations, so an abort frees its slot within one step. ``busy_s()``
tells the worker's reader thread (health probes) how long the current engine call has run.

Prefix caching: admission starts a sequence with the longest prefix of its prompt whose KV rows a slot holds
(``Engine.add``). A request whose prompt shares a longer prefix with a running sequence that is still prefilling it
waits (at most PREFIX_WAIT_S) until those rows are cached and then copies them, so requests that arrive together
with a shared uncached prefix (a common system prompt, the ``n`` choices of one request) prefill it once.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable

from core.sampling import SamplingParams
from server.engine import Engine, RequestError, Sequence, StepPlan, prefill_chunks
from server.engine.faults import fault_of
from server.worker import messages as m
from server.worker.budget import DraftBudget

log = logging.getLogger("specserve.worker")

PREFIX_WAIT_ROWS = 32  # a request waits for a running prefill only when that gains at least this many cached rows
PREFIX_WAIT_S = 30.0   # and never longer than this (the source's prefill normally ends well before)


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
        self._held: dict[str, float] = {}  # request id -> when it began waiting for another's prefill
        self.failed_steps = 0  # consecutive steps that failed in the engine as a whole (0 after one that ran)

    def busy_s(self) -> float:
        """Seconds the engine call in progress (a prefill or a step) has run; 0 between two. Safe from any thread."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _usage(self, seq: Sequence) -> dict:
        return {"drafter": self.engine.drafter.name, **seq.stats.as_dict(), "cached_tokens": seq.cached_tokens}

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def handle(self, msg: m.Generate | m.Abort | m.Shutdown) -> None:
        """One message from the API process (health probes never get here: the worker's reader thread answers them)."""
        if isinstance(msg, m.Generate):
            if msg.request_id in self.waiting or msg.request_id in self.running:
                self.send(m.Failed(msg.request_id, "duplicate request id"))
            elif len(self.waiting) >= self.max_waiting + max(0, self.engine.slots_available):
                self.send(m.Failed(msg.request_id, "the waiting queue is full", kind="overloaded"))
            else:
                self.waiting[msg.request_id] = msg
        elif isinstance(msg, m.Abort):
            req = self.waiting.pop(msg.request_id, None)
            self._held.pop(msg.request_id, None)
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
        """Give waiting requests KV slots, in arrival order; their prompts are prefilled by the following steps. A
        request that would copy a longer prefix once a running prefill has cached it waits for that (bounded)."""
        engine = self.engine
        for rid in list(self.waiting):
            if not engine.slots_available:
                break
            req = self.waiting[rid]
            if self._wait_for_prefill(rid, req):
                continue
            del self.waiting[rid]
            self._held.pop(rid, None)
            try:
                sp = sampling_params(req)
                seq = engine.add(req.prompt_ids, sp, req.max_tokens, req.stop_token_ids, namespace=req.namespace)
            except (RequestError, ValueError) as e:
                self.send(m.Failed(rid, str(e)))
                continue
            except BaseException as e:  # a fault admitting this one request (a grammar engine's panic, memory)
                if not fault_of(e):
                    raise
                log.exception("admitting request %s failed", rid)
                self.send(m.Failed(rid, fault_message("while admitting this request", e), kind="server_error"))
                continue
            self.running[rid] = seq

    def _wait_for_prefill(self, rid: str, req: m.Generate) -> bool:
        """Whether the request should wait: a running sequence is prefilling a prefix of its prompt at least
        PREFIX_WAIT_ROWS longer than what is cached now, and it has not waited PREFIX_WAIT_S yet."""
        if not req.prompt_ids or len(req.prompt_ids) >= self.engine.max_seq_len:
            return False  # admission reports the error
        if req.prompt_logprobs is not None:
            return False  # it computes every prompt row itself
        hit = self.engine.prefix_hit(req.prompt_ids, req.namespace)
        if hit.pending - hit.length < PREFIX_WAIT_ROWS:
            return False
        since = self._held.setdefault(rid, time.monotonic())
        return time.monotonic() - since < PREFIX_WAIT_S

    def tick(self) -> None:
        """Admit, then one batched step: every decoding sequence steps, prompt chunks fill the rest of the budget."""
        self.admit()
        decoding = {rid: s for rid, s in self.running.items() if s.prefilled}
        # Prompt chunks are sized as for a plain step (one row per decoding sequence); draft rows come on top, where
        # the budget finds they pay with the chunks in the step. Drafts that took the chunks' rows instead starved
        # the prompts under load (TTFT doubled at 64 streams of code prompts).
        limit = self.max_step_tokens(len(decoding)) if callable(self.max_step_tokens) else self.max_step_tokens
        chunks = prefill_chunks(self.running.values(), limit - len(decoding))
        if not decoding and not chunks:
            return
        prompt_rows = sum(n for _, n in chunks)
        plan = StepPlan(list(decoding.values()), chunks,
                        self.budget.plan(list(decoding.values()), fixed_rows=prompt_rows))
        rid_of = {seq.seq_id: rid for rid, seq in self.running.items()}
        batch = {**decoding, **{rid_of[seq.seq_id]: seq for seq, _ in chunks}}
        self._busy_since = started = time.monotonic()
        try:
            result = self.engine.run(plan)
        except BaseException as e:  # a fault of the step as a whole fails its requests, not the worker
            if not fault_of(e):
                raise
            self.failed_steps += 1
            log.exception("a step of %d requests failed in the engine (%d in a row)", len(batch), self.failed_steps)
            for rid, seq in batch.items():
                self._fail(rid, seq, fault_message(
                    "in a step with this request (not in any one request's part of it)", e))
            return
        finally:
            self._busy_since = None
        self.failed_steps = 0
        if result.failed:
            by_seq = {seq.seq_id: rid for rid, seq in batch.items()}
            for seq_id, e in result.failed.items():
                rid = by_seq[seq_id]
                log.error("request %s failed in the engine: %s: %s", rid, type(e).__name__, e, exc_info=e)
                self._fail(rid, batch.pop(rid), fault_message("in this request's part of a step", e))
                decoding.pop(rid, None)
        seconds = time.monotonic() - started
        steps = result.steps  # seq_id -> this step's share
        drafted = sum(st.draft_tokens for st in steps.values())
        rows = len(decoding) + drafted + prompt_rows
        self.send(m.Step(len(decoding), rows, drafted, prompt_rows, seconds))
        self.budget.record_step(1000 * seconds, rows, len(decoding), sum(r > 1 for r in plan.max_rows.values()),
                                1000 * sum(st.draft_seconds for st in steps.values()),
                                tokens=sum(len(result.emitted.get(s.seq_id, ())) for s in decoding.values()),
                                prefill_rows=prompt_rows)
        for seq in decoding.values():
            if seq.seq_id in steps:
                st = steps[seq.seq_id]
                self.budget.record(seq.seq_id, st.draft_tokens, st.accepted_tokens, plan.max_rows[seq.seq_id])
        for rid, seq in batch.items():
            tokens = result.emitted.get(seq.seq_id, [])
            if rid not in decoding and not tokens and seq.finish_reason is None:
                continue  # a prompt chunk that is not the last: nothing to tell yet
            st = steps.get(seq.seq_id)
            stats = [m.StepStats(st.draft_tokens, st.accepted_tokens)] if st is not None else []
            usage = None
            if seq.finish_reason is not None:
                self.running.pop(rid, None)
                self.engine.release(seq)
                self.budget.forget(seq)
                usage = self._usage(seq)
            lps = [m.Logprob(lp, top) for lp, top in seq.logprobs[len(seq.logprobs) - len(tokens):]] \
                if seq.sampling.logprobs is not None and tokens else []
            prompt_lps = None
            if rid not in decoding and seq.prompt_logprobs is not None:  # the prompt's last chunk: its first message
                prompt_lps = [None if e is None else m.Logprob(*e) for e in seq.prompt_logprobs]
            self.send(m.Tokens(rid, tokens, stats, seq.finish_reason, usage, lps, prompt_lps))

    def _fail(self, rid: str, seq: Sequence, message: str) -> None:
        """A fault ended the request: tell the API process, free its slot without caching (its rows may be half
        written) and its drafter state."""
        self.running.pop(rid, None)
        self.engine.release(seq, cache=False)
        self.budget.forget(seq)
        self.send(m.Failed(rid, message, kind="server_error"))

    def status(self) -> None:
        """Send the gauges when they changed."""
        running, cached = self.engine.kv_usage()
        p = self.engine.prefix
        now = (len(self.running), len(self.waiting), round(running, 4), round(cached, 4), p.queries, p.hits,
               p.evictions, self.failed_steps)
        if now != self._last_status:
            self._last_status = now
            self.send(m.Status(*now))


def fault_message(where: str, e: BaseException) -> str:
    return f"the engine failed {where}: {type(e).__name__}: {e}"


def sampling_params(req: m.Generate) -> SamplingParams:
    """A request's sampling parameters (raises ValueError on values out of range)."""
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                          min_p=req.min_p, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                          logit_bias=tuple(sorted(req.logit_bias.items())), logprobs=req.logprobs,
                          prompt_logprobs=req.prompt_logprobs, grammar=req.grammar)
