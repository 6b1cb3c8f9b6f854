"""Test drafters that propose random trees: chains, CAPE-shaped trees and bushy trees of up to 64 rows.

`OracleTreeDrafter` knows the reference output and hides the true continuation along a random path of each tree
(at a random sibling position), so verification accepts deep, non-prefix paths and KV compaction really moves rows.
`RandomQTreeDrafter` draws every node's token from a random draft distribution q (or makes it a point mass), for
the statistical losslessness test.
"""
from __future__ import annotations

import random

import torch

from core.tree import DraftTree


def random_shape(rng: random.Random, kind: str, rows: int) -> list[int]:
    """Parents of a random tree of `rows` rows (root included) of the given kind."""
    if kind == "chain":
        return list(range(-1, rows - 1))
    if kind == "cape":
        # a chain; each chain node after the first also gets expansion siblings (children of the previous node)
        parents, chain = [-1], [0]
        while len(parents) < rows:
            prev = chain[-1]
            parents.append(prev)
            chain.append(len(parents) - 1)
            for _ in range(rng.randint(0, 4)):
                if len(parents) < rows:
                    parents.append(prev)
        return parents
    if kind == "bushy":
        return [-1] + [rng.randrange(i) if rng.random() < 0.7 else max(0, i - 1) for i in range(1, rows)]
    raise ValueError(kind)


class OracleTreeDrafter:
    name = "test-oracle-tree"

    def __init__(self, reference: dict[tuple, list[int]], kinds=("chain", "cape", "bushy"), max_rows=64,
                 vocab_size=49152, seed=0):
        self.reference, self.kinds, self.max_rows, self.vocab = reference, kinds, max_rows, vocab_size
        self.rng = random.Random(seed)
        self.prompt: dict[int, tuple] = {}

    def prefill(self, seq):
        self.prompt[seq.seq_id] = tuple(seq.tokens[:seq.prompt_len])

    def propose(self, seq):
        rng = self.rng
        full = self.reference[self.prompt[seq.seq_id]]
        truth = full[len(seq.tokens) - seq.prompt_len:]  # the plain-decoding continuation from here
        parents = random_shape(rng, rng.choice(self.kinds), rng.randint(1, self.max_rows))
        tokens = [seq.tokens[-1]] + [rng.randrange(self.vocab) for _ in parents[1:]]
        # follow a random root-to-leaf walk, writing the true tokens on it (a random child at every level)
        children = DraftTree(tokens, parents).children()
        node, depth = 0, 0
        while children[node] and depth < len(truth) and rng.random() < 0.9:
            node = rng.choice(children[node])
            tokens[node] = truth[depth]
            depth += 1
        return DraftTree(tokens, parents)

    def observe(self, seq, result):
        pass

    def release(self, seq_id):
        self.prompt.pop(seq_id, None)


class RandomQTreeDrafter:
    """Random trees whose nodes are drawn from random q's (some are point masses, after their sampled siblings)."""

    name = "test-random-q"

    def __init__(self, vocab_size: int, max_rows: int = 12, point_mass_rate: float = 0.3, seed: int = 0):
        self.vocab, self.max_rows, self.pm = vocab_size, max_rows, point_mass_rate
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)

    def prefill(self, seq):
        pass

    def propose(self, seq):
        rng = self.rng
        parents = random_shape(rng, rng.choice(["chain", "cape", "bushy"]), rng.randint(1, self.max_rows))
        q = torch.zeros(len(parents), self.vocab)
        tokens = [seq.tokens[-1]]
        point_mass_under: set[int] = set()  # parents that already have a point-mass child: sampled siblings go first
        for i in range(1, len(parents)):
            if parents[i] in point_mass_under or rng.random() < self.pm:
                point_mass_under.add(parents[i])
                tokens.append(rng.randrange(self.vocab))  # point mass: q row stays zero
            else:
                q[i] = torch.distributions.Dirichlet(torch.full((self.vocab,), 0.3)).sample()
                tokens.append(int(torch.multinomial(q[i], 1, generator=self.gen)))
        return DraftTree(tokens, parents, q)

    def observe(self, seq, result):
        pass

    def release(self, seq_id):
        pass
