"""Lossless acceptance of a verified draft tree: greedy and seeded sampling (token-exact), speculative sampling
(distribution-exact).

Greedy: from the root follow the child whose token is the target's argmax; at the first miss (or a leaf) emit the
target's argmax there (the bonus token).

Seeded sampling: the same walk, with the target's draw in place of its argmax: the winner of the exponential race
keyed on the request's seed and the token's position (``core.sampling``). Each emitted token is a draw from the
target's distribution, and the very token plain decoding with that seed draws: a draft only decides how many of them
one step emits.

Unseeded sampling (SpecInfer-style multi-candidate speculative sampling, exact for any tree that keeps the contract of
``core.tree``): at the current node, p is the target distribution after temperature / top-k / top-p. Children are
tried in order; child c with token x and draft distribution q_c is accepted with probability min(1, p(x) / q_c(x));
on rejection p <- norm(max(p - q_c, 0)) and the next sibling is tried. A point-mass child (no q) is the special case
q_c = onehot(x): accept with probability p(x), else zero p(x) and renormalise. When no child is accepted, the bonus
token is drawn from what is left of p.

A request with a logit_bias or penalties reads its rows through :class:`ShapedRows`: row i shaped with the state after
the committed tokens and the drafted tokens on the path from the root to i (``path_tokens``), the state plain
decoding would shape that position with, so every rule above stays exact.
"""
from __future__ import annotations

import torch

from core.ops import top1
from core.sampling import SamplingParams, Shaper, race, target_probs, token_clocks
from core.tree import DraftTree


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    """The drafted tokens from the root to ``node``, root excluded (it is committed) and ``node`` included: what the
    sequence holds past its committed tokens when the target reads row ``node``."""
    path = []
    while node > 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


class ShapedRows:
    """A verified tree's target logits shaped for one request, each row when the acceptance walk first reads it:
    ``rows[i]`` is row i's [V] float32 logits after the request's :class:`Shaper` with the path to i (none: the
    logits as they are), or with ``sp`` given (a sampled request) its sampling distribution (``target_probs``).
    Sampled rows are built this way with or without a shaper: the walk reads the rows on its path, often a third of
    a tree's, and a row's top-p sort over the vocabulary costs milliseconds on a CPU."""

    def __init__(self, tree: DraftTree, logits: torch.Tensor, shaper: Shaper | None, sp: SamplingParams | None = None):
        self.tree, self.logits, self.shaper, self.sp = tree, logits, shaper, sp
        self.shape = logits.shape
        self._rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, node: int) -> torch.Tensor:
        row = self._rows.get(node)
        if row is None:
            row = self.logits[node] if self.shaper is None else self.shaper(self.logits[node],
                                                                            path_tokens(self.tree, node))
            if self.sp is not None:
                row = target_probs(row[None], self.sp)[0]
            self._rows[node] = row
        return row


def accept_greedy(tree: DraftTree, logits: torch.Tensor | ShapedRows) -> tuple[list[int], list[int]]:
    """Returns (accepted rows, root first; emitted tokens, bonus last). logits: [T+1, V], or a request's shaped rows
    (each row's argmax taken when the walk reaches it)."""
    if isinstance(logits, ShapedRows):
        return follow(tree, lambda node, depth: int(top1(logits[node])))
    best = top1(logits).tolist()  # [T+1]
    return follow(tree, lambda node, depth: best[node])


def accept_seeded(tree: DraftTree, probs: torch.Tensor | ShapedRows, seed: int, position: int
                  ) -> tuple[list[int], list[int]]:
    """Seeded sampling: follow the target's draws. probs: [T+1, V] target distributions (see target_probs), or
    ShapedRows;
    ``position``: the index of the token the root's row predicts (the sequence's length)."""
    vocab = probs.shape[-1]
    return follow(tree, lambda node, depth: race(probs[node], token_clocks(seed, position + depth, vocab))[0])


def follow(tree: DraftTree, choose) -> tuple[list[int], list[int]]:
    """From the root, follow the child whose token is ``choose(node, depth)``, the target's token after that node
    (asked only for the nodes on the path); at the first miss (or a leaf) emit the target's token there."""
    children = tree.children()
    rows, tokens, node = [0], [], 0
    while True:
        want = choose(node, len(tokens))
        nxt = next((c for c in children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            tokens.append(want)
            return rows, tokens
        rows.append(nxt)
        tokens.append(tree.tokens[nxt])
        node = nxt


def accept_sampling(tree: DraftTree, probs: torch.Tensor | ShapedRows, generator: torch.Generator
                    ) -> tuple[list[int], list[int]]:
    """Lossless tree speculative sampling. probs: [T+1, V] target distributions (see target_probs), or
    ShapedRows."""
    children = tree.children()
    q = tree.q
    sampled = tree.sampled_rows()
    rows, tokens, node = [0], [], 0
    while True:
        p = probs[node]
        rejected: list[int] = []  # tokens rejected at this node so far
        accepted = None
        for c in children[node]:
            x = tree.tokens[c]
            u = torch.rand((), generator=generator, device=p.device).item()
            if sampled[c]:
                qc = q[c].to(p.device, torch.float32)
                if u * float(qc[x]) < float(p[x]):  # u < p(x)/q(x), without dividing by a zero q(x)
                    accepted = c
                    break
                left = torch.clamp(p - qc, min=0.0)
            else:
                if u < float(p[x]):
                    accepted = c
                    break
                left = p.clone()
                left[x] = 0.0
            rejected.append(x)
            p = residual(left, probs[node], rejected)
        if accepted is None:
            tokens.append(int(torch.multinomial(p, 1, generator=generator).item()))
            return rows, tokens
        rows.append(accepted)
        tokens.append(tree.tokens[accepted])
        node = accepted


def residual(left: torch.Tensor, p_node: torch.Tensor, rejected: list[int]) -> torch.Tensor:
    """The normalised residual distribution after a rejection.

    left: [V] unnormalised mass left (max(p - q, 0), or p with the point mass zeroed); p_node: [V] the node's target
    distribution; rejected: the tokens rejected at this node. A rejection implies mass remains (p(x) < q(x)
    somewhere), so an empty ``left`` only comes from float round-off on an event of probability ~0; then what is
    left is the node's distribution without the tokens already rejected there, never a rejected token.
    """
    s = float(left.sum())
    if s > 1e-12:
        return left / s
    keep = p_node.clone()
    keep[rejected] = 0.0
    s = float(keep.sum())
    if s <= 0.0:  # every token with mass was rejected: impossible, since p(x) = 1 is always accepted
        raise RuntimeError("speculative sampling: no target mass left after the rejections at this node")
    return keep / s
