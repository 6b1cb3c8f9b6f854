"""The draft tree: what a drafter proposes and the engine verifies, and the contract exactness rests on.

A drafter proposes a :class:`DraftTree` rooted at the last accepted token; the engine verifies all of its rows in one
target forward and accepts a path losslessly (``server.engine.acceptance``). :meth:`DraftTree.validate` checks the
parts of the contract below that can be checked from the tree alone; the engine calls it on every proposal.

The contract (what greedy token-exactness and sampled distribution-exactness rest on):
1. Shape. Row 0 is the root (parent -1); rows are in topological order (``parents[i] < i``); at most
   ``MAX_TREE_ROWS`` rows; token ids in the vocabulary.
2. Sampled rows. Where ``q`` row i is not all zero, row i's token was drawn from that distribution, independently
   of its siblings and of everything else the target has not yet seen: q is a distribution (non-negative, finite,
   sums to 1) with ``q[i, token] > 0``.
3. Point masses. An all-zero q row (or ``q=None``) marks a deterministic proposal (top-k, n-gram, a copy).
4. Sibling order. Acceptance tries siblings in row order. A point-mass sibling may depend on a sampled sibling's
   token (CAPE's alternatives are the draft's next-best tokens *excluding the sampled one*), so every sampled
   sibling comes before every point-mass sibling: the sampled token is then drawn before anything that depends on
   it is tried, and its accept/reject step sees a fresh draw from q.
What cannot be checked here (that the token really came from q, independently) is each drafter's duty; the
statistical tests run every drafter's own sampling code against the target distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TREE_ROWS = 64  # root included: the verification mask is one int64 bitmask per row
Q_SUM_TOLERANCE = 1e-3  # a sampled q row must sum to 1 within this (float32 softmax over ~50k entries: ~1e-6)


@dataclass
class DraftTree:
    """Rows in topological order; row 0 is the root (the last accepted token, whose KV is not cached yet).

    tokens:  [T+1] token ids
    parents: [T+1] parent row of each row, -1 for the root; parents[i] < i
    q:       optional [T+1, V] float tensor, row i = the distribution row i's token was drawn from (independently of
             its siblings). An all-zero row (or q=None) marks a point mass: a deterministic proposal (top-k, n-gram).
             Row 0 is ignored. See the module docstring for the sibling order.
    """

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = None

    @classmethod
    def root_only(cls, root: int) -> "DraftTree":
        return cls([root], [-1])

    @classmethod
    def chain(cls, root: int, draft: list[int], q: torch.Tensor | None = None) -> "DraftTree":
        return cls([root, *draft], list(range(-1, len(draft))), q)

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    @property
    def num_draft(self) -> int:
        return len(self.tokens) - 1

    def depths(self) -> list[int]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return d

    def children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            ch[self.parents[i]].append(i)
        return ch

    def sampled_rows(self) -> list[bool]:
        """Per row: True where the row's token was drawn from its q row (a non-zero row), False for point masses."""
        if self.q is None:
            return [False] * self.num_rows
        return (self.q.sum(-1) > 0).tolist()

    def truncate(self, num_rows: int) -> "DraftTree":
        """The first ``num_rows`` rows (still a valid tree: parents precede children)."""
        if num_rows >= self.num_rows:
            return self
        q = self.q[:num_rows] if self.q is not None else None
        return DraftTree(self.tokens[:num_rows], self.parents[:num_rows], q)

    def depth_first(self) -> "DraftTree":
        """The same tree in depth-first order, children in their row order: each node's first child follows it with
        its whole subtree, so the rows open with the longest chain of first children. Drafters list the likeliest
        child first, so that chain is the likeliest path, and the engine verifies this order: its leading chain runs
        in place (a branch row's keys are gathered) and an accepted path along it needs no KV compaction. Siblings
        keep their order, so acceptance tries the same tokens in the same order. ``self`` where already so."""
        children = self.children()
        order, stack = [], [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(children[node]))
        if order == list(range(len(order))):
            return self
        new = {old: i for i, old in enumerate(order)}
        return DraftTree([self.tokens[o] for o in order], [-1] + [new[self.parents[o]] for o in order[1:]],
                         self.q[order] if self.q is not None else None)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError where the tree breaks the contract of the module docstring."""
        n = len(self.tokens)
        if n < 1 or len(self.parents) != n:
            raise ValueError(f"draft tree: {n} tokens but {len(self.parents)} parents")
        if n > MAX_TREE_ROWS:
            raise ValueError(f"draft tree has {n} rows; at most {MAX_TREE_ROWS} (root included)")
        if self.parents[0] != -1:
            raise ValueError("draft tree: row 0 must be the root (parent -1)")
        for i in range(1, n):
            if not 0 <= self.parents[i] < i:
                raise ValueError(f"draft tree: row {i} has parent {self.parents[i]}; rows must be topological")
        if any(not 0 <= t < vocab_size for t in self.tokens):
            raise ValueError(f"draft tree: token id out of range [0, {vocab_size})")
        if self.q is None:
            return
        if tuple(self.q.shape) != (n, vocab_size):
            raise ValueError(f"draft tree: q has shape {tuple(self.q.shape)}, expected {(n, vocab_size)}")
        q = self.q[1:].float()  # [T, V]; the root's row is ignored
        sums = q.sum(-1)  # [T]
        sampled = sums > 0
        if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
            raise ValueError("draft tree: q rows must be finite and non-negative")
        bad = sampled & ((sums - 1.0).abs() > Q_SUM_TOLERANCE)
        if bool(bad.any()):
            i = int(bad.nonzero()[0]) + 1
            raise ValueError(f"draft tree: q row {i} sums to {float(sums[i - 1]):.6g}; a sampled row must be a "
                             "distribution (an all-zero row marks a point mass)")
        at_token = q.gather(1, torch.tensor(self.tokens[1:], device=q.device)[:, None])[:, 0]  # [T]
        bad = sampled & (at_token <= 0)
        if bool(bad.any()):
            i = int(bad.nonzero()[0]) + 1
            raise ValueError(f"draft tree: row {i}'s token {self.tokens[i]} has q = 0: a sampled token must have been "
                             "drawn from its q row")
        is_sampled = [False, *sampled.tolist()]
        for node, kids in enumerate(self.children()):
            seen_point_mass = False
            for c in kids:
                if not is_sampled[c]:
                    seen_point_mass = True
                elif seen_point_mass:
                    raise ValueError(f"draft tree: row {c} (sampled) comes after a point-mass sibling under row "
                                     f"{node}; sampled siblings must come first")


@dataclass
class VerifyResult:
    """What verification decided for one tree."""

    accepted_rows: list[int]  # the accepted path, root (row 0) first
    tokens: list[int]         # tokens emitted: the accepted draft tokens, then the target's bonus token
    num_draft: int            # draft rows proposed (root excluded)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_rows) - 1
