"""`cascade`: Cascade Speculative Drafting with two drafters, a neural reviewer (GLIDE) over Max-Gram.

Vertical cascade: Max-Gram proposes ``k21`` tokens; the reviewer scores them all in ONE forward
(``GlideDrafter.review``) and runs a speculative step of its own on them. Greedy requests: a token passes when it is
the reviewer's top token or -- leniency l >= 1 -- when the reviewer gives it probability above 1/l. Sampled requests:
it passes with probability min(1, l * q(x)) (the paper's rule against a point mass). The passed tokens plus the
reviewer's own token at the first miss (or after the last token when all pass) are the reviewed draft. Review
rounds repeat from the extended context until the reviewed draft holds at least ``k11`` tokens.

Horizontal cascade: Max-Gram alone then extends the draft to ``k12`` tokens (later positions, which the target
rejects more often, get the cheapest drafter). These are the paper's K matrix for two drafters,

    K = [[k11, k12],   # the target's step: positions 1..k11 from the reviewed level, then up to k12 from Max-Gram
         [k21]]        # the reviewer's step: tokens Max-Gram proposes per review

Branch (option ``branch``, on by default): where the reviewer rejects Max-Gram's token, Max-Gram's own continuation from that
position stays in the draft as a sibling branch of the reviewed tokens, so the target verifies both: a tree. On text
the prompt already holds (code edits, quoting) Max-Gram's copies are often right where a small reviewer disagrees;
on open chat the reviewed chain carries the step.

Expand (option ``expand``, on by default: CAPE over the review): every reviewed position already has the reviewer's
distribution from the review forward, so CAPE's confidence-aware expansion costs no extra drafter forward there: the
reviewer's next-best tokens join the tree as siblings of the reviewed token, as many as the CAPE bin of its
confidence gives, up to ``max_rows`` rows. This is what puts the cascade ahead of `glide-cape` on open chat, where
Max-Gram rarely matches and the step rests on the reviewer.

Leniency only ever loosens the reviewer's step: the whole draft goes to the target as point masses (for greedy and
sampled requests alike), and the target's verification keeps the output exactly its own.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from core.sampling import request_generator
from core.tree import MAX_TREE_ROWS, DraftTree, VerifyResult
from drafters.base import SequenceView, TargetView
from drafters.cape import PAPER_BINS, add_expansion, check_bins
from drafters.cascade.maxgram import MaxGram, load_bigram

# Default K matrix [[k11, k12], [k21]]: one review round per step (every round yields at least one token), Max-Gram
# proposing 10 tokens per review as in the paper, drafts of 6 tokens.
DEFAULT_K = ((1, 6), (10,))


def rewind(reviewer: Any, seq: SequenceView) -> None:
    """Drop the previous review round's rows from the reviewer's cache, so the next review starts at the root.

    An empty verification result says nothing after the verified text is confirmed: GlideDrafter.observe then keeps
    only the verified prefix of its cache. (GlideDrafter.review also does this itself; the call keeps the cascade
    correct for any reviewer with the same observe contract.)
    """
    reviewer.observe(seq, VerifyResult(accepted_rows=[0], tokens=[], num_draft=0))


def check_k(k: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """[[k11, k12], [k21]] -> (k11, k12, k21), with 1 <= k11 <= k12 <= 63 and 1 <= k21 <= 63."""
    try:
        (k11, k12), (k21,) = k
        k11, k12, k21 = int(k11), int(k12), int(k21)
    except (TypeError, ValueError):
        raise ValueError(f"cascade: k must be the K matrix [[k11, k12], [k21]], got {k!r}") from None
    if not 1 <= k11 <= k12 <= 63 or not 1 <= k21 <= 63:
        raise ValueError(f"cascade: need 1 <= k11 <= k12 <= 63 and 1 <= k21 <= 63, got k={k!r}")
    return k11, k12, k21


def review_step(proposal: list[int], probs: torch.Tensor, leniency: float = 1.0,
                generator: torch.Generator | None = None) -> tuple[int, int]:
    """The reviewer's speculative step on a point-mass proposal -> (tokens that pass, the reviewer's next token).

    probs: [len(proposal) + 1, V], row i = the reviewer's distribution after proposal[:i]. Greedy (no generator):
    proposal[i] passes when it is the row's argmax or its probability is above 1/leniency; the reviewer's token is
    the argmax of the first row that fails (or of the last row). Sampled: proposal[i] passes with probability
    min(1, leniency * p); at a miss the reviewer's token is drawn from the row without proposal[i] (the residual
    of speculative sampling against a point mass), after the last row from the row itself.
    """
    n = len(proposal)
    idx = torch.arange(n, device=probs.device)
    p_prop = probs[idx, torch.tensor(proposal, dtype=torch.long, device=probs.device)].tolist()
    if generator is None:
        top = probs.argmax(-1).tolist()
        for i, (x, p) in enumerate(zip(proposal, p_prop)):
            if x != top[i] and p * leniency <= 1.0:
                return i, top[i]
        return n, top[n]
    for i, (x, p) in enumerate(zip(proposal, p_prop)):
        u = float(torch.rand((), generator=generator, device=generator.device))
        if u >= min(1.0, leniency * p):
            residual = probs[i].clone()
            residual[x] = 0.0
            if float(residual.sum()) <= 0.0:  # all the mass sat on x (rounding): nothing else to draw
                return i, int(probs[i].argmax())
            return i, int(torch.multinomial(residual, 1, generator=generator).item())
    return n, int(torch.multinomial(probs[n], 1, generator=generator).item())


def cascade_draft(seq: SequenceView, maxgram: MaxGram, reviewer: Any, k11: int, k12: int, k21: int,
                  leniency: float = 1.0, generator: torch.Generator | None = None,
                  branches: list[tuple[int, list[int]]] | None = None,
                  expansions: list[tuple[int, torch.Tensor]] | None = None) -> list[int]:
    """The draft (without the root) for one target step: reviewed rounds up to k11 tokens, Max-Gram up to k12.

    ``reviewer`` needs ``review(seq, draft) -> probs [len(draft) + 1, V]`` and ``observe`` (GlideDrafter's).
    ``branches``: when given, every round whose review rejects a Max-Gram token appends (depth, tokens) to it: the
    tokens Max-Gram proposed from that position on, whose first one would sit at draft index ``depth``.
    ``expansions``: when given, gets (depth, probs) for every reviewed draft index: the reviewer's distribution there.
    """
    tokens, prompt_len = seq.tokens, seq.prompt_len
    reviewed: list[int] = []
    rounds = 0
    while len(reviewed) < k11:  # vertical cascade
        proposal = maxgram.extend(tokens + reviewed, prompt_len, k21)
        if rounds:
            rewind(reviewer, seq)
        probs = reviewer.review(seq, reviewed + proposal)[len(reviewed):]
        n_pass, own = review_step(proposal, probs, leniency, generator)
        if branches is not None and n_pass < len(proposal):
            branches.append((len(reviewed) + n_pass, proposal[n_pass:]))
        if expansions is not None:
            expansions += [(len(reviewed) + i, probs[i]) for i in range(n_pass + 1)]
        reviewed += proposal[:n_pass] + [own]
        rounds += 1
    draft = reviewed[:k12]
    return draft + maxgram.extend(tokens + draft, prompt_len, k12 - len(draft))  # horizontal cascade


def review_expansions(rows: list[tuple[int, torch.Tensor]], max_expand: int) -> list[tuple[int, list[int], float]]:
    """The reviewer's rows (depth, probs [V]) -> (depth, its top 1 + max_expand tokens with nonzero probability best
    first, confidence = the row's top probability): what ``cascade_tree`` expands from."""
    top = torch.topk(torch.stack([p for _, p in rows]), 1 + max_expand)
    return [(depth, [t for t, v in zip(ids, vals) if v > 0.0], vals[0])
            for (depth, _), ids, vals in zip(rows, top.indices.tolist(), top.values.tolist())]


def cascade_tree(root: int, draft: list[int], branches: list[tuple[int, list[int]]], max_depth: int,
                 expansions: Sequence[tuple[int, list[int], float]] = (),
                 bins: Sequence[tuple[float, int]] = PAPER_BINS, max_rows: int = MAX_TREE_ROWS) -> DraftTree:
    """The draft chain (rows 1..len(draft), first so it verifies in decode form) plus each branch as a chain hanging
    off the chain row before its depth, cut to ``max_depth`` tokens from the root and to the tree's row limit; then
    each expansion (depth, ranked alternatives, confidence): up to S(confidence) alternatives as single-token siblings
    of the draft token at ``depth``, skipping tokens already a child there, while the tree has fewer than
    ``max_rows`` rows (branches and the chain are never cut for expansions)."""
    tokens, parents = [root, *draft], list(range(-1, len(draft)))
    for depth, branch in branches:
        # the chain row at ``depth`` (draft index depth - 1) is the branch's parent; same token there: nothing new
        branch = branch[:max(0, min(max_depth - depth, MAX_TREE_ROWS - len(tokens)))]
        if not branch or depth > len(draft) or (depth < len(draft) and branch[0] == draft[depth]):
            continue
        parents += [depth] + list(range(len(tokens), len(tokens) + len(branch) - 1))
        tokens += branch
    max_rows = min(max_rows, MAX_TREE_ROWS)
    for depth, alts, conf in expansions:
        if depth >= len(draft):
            continue
        children = {t for t, p in zip(tokens, parents) if p == depth}
        add_expansion(tokens, parents, depth, [t for t in alts if t not in children], conf, bins, max_rows)
    return DraftTree(tokens, parents)


class CascadeDrafter:
    name = "cascade"

    def __init__(self, target: TargetView, checkpoint: str | None = None, k: Sequence[Sequence[int]] = DEFAULT_K,
                 leniency: float = 1.0, bigram: str | None = None, min_match: int = 1, branch: bool = True,
                 expand: bool = True, bins: list | tuple = PAPER_BINS, max_rows: int = 16, weights: str = "auto"):
        from drafters.glide.drafter import GlideDrafter

        self.k11, self.k12, self.k21 = check_k(k)
        if not leniency >= 1.0:
            raise ValueError("cascade: leniency must be >= 1 (1 = the reviewer's plain speculative step)")
        self.leniency = float(leniency)
        self.branch = bool(branch)
        if not 2 <= max_rows <= MAX_TREE_ROWS:
            raise ValueError(f"cascade: max_rows must be in [2, {MAX_TREE_ROWS}]")
        self.expand, self.bins, self.max_rows = bool(expand), check_bins(bins), int(max_rows)
        self.max_expand = max(k for _, k in self.bins)
        self.target = target
        self.maxgram = MaxGram(load_bigram(target, bigram), min_match)
        self.reviewer = GlideDrafter(target, checkpoint=checkpoint, gamma=min(self.k21, 63), weights=weights)
        self._generators: dict[int, torch.Generator] = {}

    # The reviewer is the only model that runs: its counters are the drafter's (`specserve bench offline`).
    @property
    def num_forwards(self) -> int:
        return self.reviewer.num_forwards

    @property
    def forward_seconds(self) -> float:
        return self.reviewer.forward_seconds

    def _generator(self, seq: SequenceView) -> torch.Generator | None:
        if seq.sampling.greedy:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = self._generators[seq.seq_id] = request_generator(seq.sampling, self.target.device, offset=2)
        return gen

    def prefill(self, seq: SequenceView) -> None:
        self._generators.pop(seq.seq_id, None)
        self.reviewer.prefill(seq)

    def propose(self, seq: SequenceView) -> DraftTree:
        branches: list[tuple[int, list[int]]] | None = [] if self.branch else None
        rows: list[tuple[int, torch.Tensor]] | None = [] if self.expand else None
        budget = seq.max_rows - 1  # draft tokens this step verifies
        k12 = min(self.k12, budget)
        draft = cascade_draft(seq, self.maxgram, self.reviewer, min(self.k11, k12), k12, self.k21, self.leniency,
                              self._generator(seq), branches, rows)
        expansions = review_expansions(rows, self.max_expand) if rows else []
        if not branches and not expansions:
            return DraftTree.chain(seq.tokens[-1], draft)
        return cascade_tree(seq.tokens[-1], draft, branches or [], k12, expansions, self.bins,
                            min(self.max_rows, seq.max_rows)).truncate(seq.max_rows)  # branches past the budget

    def observe(self, seq: SequenceView, result: VerifyResult) -> None:
        self.reviewer.observe(seq, result)

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        self.reviewer.release(seq_id)
