"""The typed contract between the scheduler and the engine: what one batched step runs (``StepPlan``), what it gave
back (``StepResult``), and how a step's rows are shared between decoding sequences and prompt chunks
(``prefill_chunks``, used by the server's scheduler and by the training data generator alike)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from server.engine.sequence import Sequence

MIN_PREFILL_CHUNK = 16  # prompt tokens a step prefills even when the decoding sequences fill the budget


@dataclass
class StepPlan:
    """One target forward: a speculative step for each sequence of ``decode`` and the next ``n`` prompt tokens of
    each (sequence, n) of ``prefill``. ``max_rows`` caps a decoding sequence's tree rows by its id (root included;
    default ``core.tree.MAX_TREE_ROWS``); at 1 the drafter is not asked and the step is a plain decode step (but for
    the tokens a request's grammar forces, which it still verifies)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    max_rows: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SeqStep:
    """One decoding sequence's share of a step."""

    draft_tokens: int      # draft rows verified (root excluded)
    accepted_tokens: int   # of them accepted
    draft_seconds: float   # the drafter's propose call


@dataclass
class StepResult:
    emitted: dict[int, list[int]]   # seq_id -> tokens emitted (a prompt's first token comes with its last chunk)
    steps: dict[int, SeqStep]       # seq_id -> its share, for every decoding sequence that stepped
    forward_seconds: float = 0.0    # wall time of the target forward (logits included)
    # seq_id -> the fault that ended it in this step (its own drafting, shaping, sampling or bookkeeping raised): the
    # caller fails that request and frees its slot without caching; the step went on for the others
    failed: dict[int, BaseException] = field(default_factory=dict)


def prefill_chunks(seqs: Iterable[Sequence], room: int) -> list[tuple[Sequence, int]]:
    """Prompt chunks for one step, in order: each sequence whose prompt is not all cached takes what is left of
    ``room`` rows (at least MIN_PREFILL_CHUNK, so prompts advance when the decoding rows fill the step) until the room
    is spent."""
    chunks = []
    for seq in seqs:
        if seq.prefilled:
            continue
        n = min(seq.prompt_len - seq.cache_len, max(room, MIN_PREFILL_CHUNK))
        if n < 1 or (chunks and room < 1):
            break
        chunks.append((seq, n))
        room -= n
    return chunks
