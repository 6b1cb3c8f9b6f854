"""Batched generation on the serving engine for the training pipeline: jobs that ask for generations in turn.

A job is a generator: it yields a ``GenRequest`` (prompt ids, sampling, token cap, stop tokens), gets its
``GenResult`` back, may ask again (a multi-turn prompt of ``train prompts`` asks three times) and returns its record.
``BatchedGenerator`` runs many jobs through one engine, one batched target forward per step, as the server's scheduler
does, so the answers of ``train data`` (training/data.py) and the prompts of ``train prompts`` (training/synth.py)
are generated over the weights, dtype and kernels that will serve, at the engine's throughput.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable


@dataclass(frozen=True)
class GenRequest:
    prompt_ids: list[int]
    sampling: Any              # core.sampling.SamplingParams
    max_new_tokens: int
    stop_ids: tuple[int, ...]


@dataclass(frozen=True)
class GenResult:
    token_ids: list[int]       # generated tokens, the stop token included when the sequence stopped
    finish_reason: str         # "stop", "length", or "refused" (the engine could not take the prompt)


# A job asks for one or more generations in turn (``yield request`` returns its result) and returns its record.
Job = Generator[GenRequest, GenResult, Any]


def single(request: GenRequest) -> Job:
    """A job of one generation: returns its GenResult."""
    return (yield request)


class BatchedGenerator:
    """Runs many jobs through one engine, one batched target forward per step.

    The loop is the server scheduler's (server/worker/scheduler.py) without its queues and budget: free KV slots take
    the next requests, then one ``Engine.run`` decodes every sequence whose prompt is cached and prefills prompt chunks
    of the others in the rows left under ``step_tokens``. Plain decoding: no drafter is asked.
    """

    def __init__(self, cfg, target, slots: int, max_seq_len: int, step_tokens: int = 512):
        from server.config import DrafterConfig
        from server.engine import MIN_PREFILL_CHUNK, Engine

        if slots < 1:
            raise ValueError("the batch needs at least one sequence")
        max_seq_len = min(max_seq_len, target.max_positions)
        cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, num_slots=slots, max_seq_len=max_seq_len),
                                  drafter=DrafterConfig(name="none"))
        self.engine = Engine(cfg, target=target)
        self.step_tokens = max(step_tokens, slots + MIN_PREFILL_CHUNK)

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    def run(self, jobs: Iterable[Job], on_step: Callable[[int, int], None] | None = None,
            on_done: Callable[[int, Any], None] | None = None) -> list:
        """Every job's return value, in job order. ``on_step(tokens, jobs_done)`` follows each batched step;
        ``on_done(job index, return value)`` is called as each job returns, so a caller can stream many shards'
        jobs through one run and keep the batch full across shard boundaries."""
        from server.engine import RequestError

        pending, ready, running, results = enumerate(jobs), deque(), [], {}
        exhausted = False

        def advance(jid: int, job: Job, result: GenResult | None) -> None:
            try:
                ready.append((jid, job, next(job) if result is None else job.send(result)))
            except StopIteration as stop:
                results[jid] = stop.value
                if on_done is not None:
                    on_done(jid, stop.value)

        while True:
            done_before = len(results)
            while self.engine.slots_available:
                if not ready:
                    nxt = None if exhausted else next(pending, None)
                    if nxt is None:
                        exhausted = True
                        break
                    advance(*nxt, None)
                    continue
                jid, job, req = ready.popleft()
                try:
                    seq = self.engine.add(list(req.prompt_ids), req.sampling, req.max_new_tokens, req.stop_ids)
                except RequestError:
                    advance(jid, job, GenResult([], "refused"))
                    continue
                running.append((jid, job, seq))
            if not running:
                if on_step and len(results) > done_before:
                    on_step(0, len(results) - done_before)
                if exhausted and not ready:
                    break
                continue
            emitted = self._step([seq for _, _, seq in running])
            still = []
            for jid, job, seq in running:
                if seq.finish_reason is None:
                    still.append((jid, job, seq))
                    continue
                self.engine.release(seq)
                advance(jid, job, GenResult(list(seq.output_ids), seq.finish_reason))
            running = still
            if on_step:
                on_step(emitted, len(results) - done_before)
        return [results[i] for i in range(len(results))]

    def _step(self, seqs: list) -> int:
        """One batched forward: decode steps for the cached sequences, prompt chunks for the rest (sized as the
        server's scheduler sizes them) -> tokens emitted."""
        from server.engine import StepPlan, prefill_chunks

        decoding = [s for s in seqs if s.prefilled]
        chunks = prefill_chunks(seqs, self.step_tokens - len(decoding))
        result = self.engine.run(StepPlan(decoding, chunks, {s.seq_id: 1 for s in decoding}))
        for e in result.failed.values():  # offline: a sequence's fault ends the run, as it was raised
            raise e
        return sum(len(t) for t in result.emitted.values())
