"""The load-aware draft budget: how many tree rows each sequence verifies in the next batched step.

Speculation trades verify rows for tokens. Alone on the machine a sequence's extra rows are nearly free (T(8) is
about 1.1 T(1) on a 2-core CPU in bfloat16); in a full batch every extra row costs as much as another sequence's
decode row. So each step the budget gives rows where they buy the most tokens per second of the whole step
(goodput, as in SmartSpec):

- ``cost(rows)``: the target's measured step time against the total rows of the step (``stepcost.step_costs``);
- per sequence, its drafter's acceptance rate a (a decayed count of accepted / tried draft tokens, where a step tries
  tokens up to its first rejection), so a chain of r rows is expected to emit 1 + a + ... + a^(r-1) tokens;
- rows are handed out one at a time to the sequence whose next row has the highest expected gain a^r, while the
  step's expected tokens per second still grow. A sequence left at 1 row takes a plain decode step: the drafter is
  not asked (``Engine.run``'s ``max_rows``), so a budget of 0 costs nothing over plain decoding.

A drafter that proposes fewer rows than it was allowed (``none``, a short n-gram match) is not given more than it
used; its cap grows again by one row per step, so it can draft longer when it has more to say.
"""
from __future__ import annotations

import bisect
from typing import Callable, Iterable

from core.tree import MAX_TREE_ROWS


class DraftBudget:
    def __init__(self, cost: Callable[[int], float] | None, max_rows: int = MAX_TREE_ROWS, prior: float = 0.5,
                 decay: float = 0.8):
        self.cost, self.max_rows, self.prior, self.decay = cost, max_rows, prior, decay
        self._accepted: dict[int, float] = {}  # seq_id -> decayed accepted draft tokens
        self._tried: dict[int, float] = {}     # seq_id -> decayed tried draft tokens
        self._cap: dict[int, int] = {}         # seq_id -> rows it may get (grows back after short proposals)
        self._last: dict[int, int] = {}        # seq_id -> rows its last step verified
        self.last_plan: dict[int, int] = {}

    @classmethod
    def fixed(cls, max_rows: int = MAX_TREE_ROWS) -> "DraftBudget":
        """Every sequence drafts what its drafter proposes (up to ``max_rows``), whatever the load."""
        return cls(None, max_rows)

    @staticmethod
    def from_curve(curve: dict[int, float], **kw) -> "DraftBudget":
        """A budget whose step cost interpolates a measured curve {rows: ms} (linearly, extrapolated past its ends)."""
        xs = sorted(curve)
        ys = [curve[x] for x in xs]

        def cost(rows: int) -> float:
            if len(xs) == 1:
                return ys[0] * max(rows, 1) / xs[0] if rows > xs[0] else ys[0]
            i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return max(y0 + (y1 - y0) * (rows - x0) / (x1 - x0), 1e-6)

        return DraftBudget(cost, **kw)

    def acceptance(self, seq_id: int) -> float:
        """The sequence's estimated per-token acceptance rate (the prior, weighted as one tried token, at start)."""
        return (self._accepted.get(seq_id, 0.0) + self.prior) / (self._tried.get(seq_id, 0.0) + 1.0)

    def plan(self, seqs: list, fixed_rows: int = 0) -> dict[int, int]:
        """{seq_id: max tree rows (root included)} for the sequences that step next; ``fixed_rows`` other rows
        (prompt chunks) share the step."""
        if self.cost is None:
            self.last_plan = {s.seq_id: self.max_rows for s in seqs}
            return self.last_plan
        rows = {s.seq_id: 1 for s in seqs}
        rate = {s.seq_id: self.acceptance(s.seq_id) for s in seqs}
        caps = {s.seq_id: self._cap.get(s.seq_id, self.max_rows) for s in seqs}
        total = len(seqs) + fixed_rows
        tokens = float(len(seqs))  # expected tokens emitted by the step: 1 per sequence without drafts
        step = self.cost(total)
        while True:
            open_ = [i for i in rows if rows[i] < caps[i]]
            if not open_:
                break
            best = max(open_, key=lambda i: rate[i] ** rows[i])
            gain = rate[best] ** rows[best]
            longer = self.cost(total + 1)
            if (tokens + gain) / longer <= tokens / step:
                break
            rows[best] += 1
            tokens, total, step = tokens + gain, total + 1, longer
        self.last_plan = rows
        return rows

    def expected_rows(self, seq_id: int, allowed: int) -> int:
        """Rows a sequence allowed ``allowed`` will likely verify (its last step's count, capped)."""
        return min(allowed, self._last.get(seq_id, allowed))

    def record(self, seq_id: int, drafted: int, accepted: int, allowed: int) -> None:
        """One step of a sequence: ``drafted`` draft tokens verified, ``accepted`` of them accepted, under a cap of
        ``allowed`` rows."""
        self._last[seq_id] = drafted + 1
        if drafted == 0 and allowed <= 1:
            return  # a plain decode step: nothing learned about the drafter
        tried = accepted + (1 if accepted < drafted else 0)
        self._accepted[seq_id] = self.decay * self._accepted.get(seq_id, 0.0) + accepted
        self._tried[seq_id] = self.decay * self._tried.get(seq_id, 0.0) + tried
        proposed = drafted + 1
        self._cap[seq_id] = min(self.max_rows, proposed + 1) if proposed < allowed else self.max_rows

    def forget(self, seq) -> None:
        for d in (self._accepted, self._tried, self._cap, self._last, self.last_plan):
            d.pop(seq.seq_id, None)
