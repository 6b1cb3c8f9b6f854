"""The load-aware draft budget: which sequences draft in the next batched step, and how many tree rows they verify.

Speculation trades work for tokens. Alone on the machine drafting nearly always pays (a verify of 8 rows costs about
1.1 decode steps on a 2-core CPU in bfloat16); in a full batch every drafting sequence adds its drafter's forward and
its tree rows to a step that all sequences wait for, and plain decoding is the better use of the step. So before each
step the budget keeps drafting only where it raises the expected tokens per second of the whole step (goodput, as in
SmartSpec), from costs and gains measured as the server runs:

- ``cost(rows)``: the target's step time against the total rows of the step, measured at start
  (``stepcost.step_costs``);
- per drafting sequence: its drafter's ``propose`` time, measured, a decayed mean over recent steps; per sequence,
  what a step costs beyond its rows' share of the curve and the proposals (acceptance, attention calls);
- the draft tokens a drafting step accepts (the drafter's decayed mean over recent steps of all sequences), and per
  sequence the rows its drafter proposed last time.

Sequences are taken in order of expected accepted tokens per unit of cost, each kept while the step's expected tokens
per second still grow. A sequence left out takes a plain decode step: the drafter is not called (``Engine.run``'s
``max_rows`` of 1), so under full load speculation costs nothing over plain decoding.

The model can be wrong where its parts interact (a drafting sequence's tree attention, its drafter catching up,
``observe``: costs the step pays that no part measures alone). So a measured gate has the last word: per load level
(the number of stepping sequences, in powers of two) it keeps the decayed ms per emitted token of the steps that
drafted as planned and of plain steps, and a planned draft goes ahead only while drafting measures faster; every
``EXPLORE_EVERY``-th planned step of a level tries the other arm, so the measurement follows the load.
"""
from __future__ import annotations

from typing import Callable

from core.tree import MAX_TREE_ROWS
from server.engine.stepcost import curve_cost

EXPLORE_EVERY = 16  # a level's planned steps take the arm its measurements do not favour once in this many
GATE_WARMUP = 4     # steps measured per arm and level before the measurements decide
GATE_DECAY = 0.95   # the gate's decayed sums forget a step's weight over about 20 steps of its arm


class DraftBudget:
    def __init__(self, cost: Callable[[int], float] | None, max_rows: int = MAX_TREE_ROWS, decay: float = 0.8,
                 accept_decay: float = 0.95):
        self.cost, self.max_rows, self.decay, self.accept_decay = cost, max_rows, decay, accept_decay
        self._rows: dict[int, int] = {}        # seq_id -> rows its drafter proposed last time (root included)
        # Draft tokens a drafting step is expected to accept: the drafter's decayed mean over recent drafting steps of
        # all sequences, optimistic at start. (Per-sequence means were tried: a few unlucky steps froze a sequence out
        # of drafting, and its estimate never recovered while it did not draft.)
        self.mean_accepted = 1.0
        self.draft_ms = 0.0                    # decayed mean cost of drafting one sequence in a step, beyond its rows
        self.seq_ms = 0.0                      # decayed mean per-sequence cost of a step beyond its rows
        # the gate: {load level: {"draft" | "plain": [decayed ms, decayed tokens, steps]}}, and its planned steps
        self.gate: dict[int, dict[str, list[float]]] = {}
        self._planned: dict[int, int] = {}
        self._arm: tuple[int, str] | None = None  # (level, arm) of the step planned last, until it is recorded

    @classmethod
    def fixed(cls, max_rows: int = MAX_TREE_ROWS) -> "DraftBudget":
        """Every sequence drafts what its drafter proposes (up to ``max_rows``), whatever the load."""
        return cls(None, max_rows)

    @staticmethod
    def from_curve(curve: dict[int, float], **kw) -> "DraftBudget":
        """A budget whose step cost (ms) interpolates a measured curve {rows: ms} (``stepcost.curve_cost``)."""
        return DraftBudget(curve_cost(curve), **kw)

    def plan(self, seqs: list, fixed_rows: int = 0) -> dict[int, int]:
        """{seq_id: max tree rows (root included)} for the sequences that step next: 1 (a plain decode step) or what
        the drafter may propose; ``fixed_rows`` other rows (prompt chunks) share the step."""
        if self.cost is None:
            return {s.seq_id: self.max_rows for s in seqs}
        plan = {s.seq_id: 1 for s in seqs}
        rows, drafting = len(seqs) + fixed_rows, 0
        tokens, spent = float(len(seqs)), self.cost(rows) + self.seq_ms * len(seqs)

        def extra_rows(i: int) -> int:
            return self._rows.get(i, 8) - 1  # before a first proposal: a typical tree

        def value(i: int) -> float:  # accepted tokens per ms that drafting adds to an otherwise plain step
            return self.mean_accepted / max(self.draft_ms + self.cost(rows + extra_rows(i)) - self.cost(rows),
                                                   1e-3)

        for i in sorted(plan, key=value, reverse=True):
            more = extra_rows(i)
            longer = self.cost(rows + more) + self.seq_ms * len(seqs) + self.draft_ms * (drafting + 1)
            gained = tokens + self.mean_accepted
            if more < 1 or gained / longer <= tokens / spent:
                break
            plan[i] = self.max_rows
            rows, drafting, tokens, spent = rows + more, drafting + 1, gained, longer
        level = len(seqs).bit_length()
        arm = self._gate_arm(level) if drafting else "plain"
        self._arm = (level, arm)
        return plan if arm == "draft" else {i: 1 for i in plan}

    def _gate_arm(self, level: int) -> str:
        """The arm a step the model wants to draft takes at this load level (see the module docstring)."""
        arms = self.gate.setdefault(level, {"draft": [0.0, 0.0, 0], "plain": [0.0, 0.0, 0]})
        d, p = arms["draft"], arms["plain"]
        if d[2] < GATE_WARMUP or p[2] < GATE_WARMUP:
            return "draft" if d[2] <= p[2] else "plain"
        self._planned[level] = n = self._planned.get(level, 0) + 1
        better = "draft" if d[0] / max(d[1], 1e-9) <= p[0] / max(p[1], 1e-9) else "plain"
        if n % EXPLORE_EVERY == 0:
            return "plain" if better == "draft" else "draft"
        return better

    def record(self, seq_id: int, drafted: int, accepted: int, allowed: int) -> None:
        """One step of a sequence: ``drafted`` draft tokens verified, ``accepted`` of them accepted, when allowed
        ``allowed`` rows (1: it did not draft, nothing is learned)."""
        if allowed <= 1:
            return
        self._rows[seq_id] = drafted + 1
        a = self.accept_decay
        self.mean_accepted = a * self.mean_accepted + (1 - a) * accepted

    def record_step(self, step_ms: float, rows: int, sequences: int, drafting: int, propose_ms: float,
                    tokens: int = 0, prefill_rows: int = 0) -> None:
        """A whole step took ``step_ms`` for ``rows`` rows of ``sequences`` stepping sequences, ``drafting`` of them
        drafting, whose drafters' ``propose`` calls took ``propose_ms`` in all, and emitted ``tokens`` tokens for
        them; ``prefill_rows`` of the rows were prompt chunks. A drafting sequence costs its proposal (measured
        directly); what neither the rows' cost curve nor the proposals explain is per-sequence work (acceptance,
        attention calls, bookkeeping), spread over all sequences. The gate learns the step's ms per token, the
        prompt chunks' share of the curve taken out."""
        if self.cost is None or sequences == 0:
            return
        if self._arm is not None and tokens > 0:
            level, arm = self._arm
            ms = step_ms - (self.cost(rows) - self.cost(rows - prefill_rows) if prefill_rows else 0.0)
            g = self.gate.setdefault(level, {"draft": [0.0, 0.0, 0], "plain": [0.0, 0.0, 0]})[arm]
            g[0], g[1], g[2] = GATE_DECAY * g[0] + max(ms, 0.0), GATE_DECAY * g[1] + tokens, g[2] + 1
        self._arm = None
        d = self.decay
        rest = step_ms - propose_ms - self.cost(rows)
        self.seq_ms = d * self.seq_ms + (1 - d) * max(0.0, rest / sequences)
        if drafting:
            self.draft_ms = d * self.draft_ms + (1 - d) * propose_ms / drafting

    def forget(self, seq) -> None:
        self._rows.pop(seq.seq_id, None)
