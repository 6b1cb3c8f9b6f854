"""CAPE: confidence-aware proposal expansion (Du et al., ICML 2024, section 4.2).

A chain drafter proposes x_1..x_gamma, each with the draft model's confidence p_i = max p_D(. | x_<i). CAPE adds K_i =
S(p_i) next-best tokens at position i as extra children of the chain node before it (siblings of x_i); expansion
tokens are not drafted further. Low confidence buys a large expansion set, high confidence a small one. The expanded
proposal is verified as a tree by the engine; expansion tokens are point masses (a zero q row), so acceptance stays
lossless for greedy and sampled decoding alike.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from core.tree import MAX_TREE_ROWS, DraftTree

# (upper bound of the confidence bin, expansion-set size): the paper's S(p) = 7, 5, 3, 1 for p in (0, .3], (.3, .6],
# (.6, .8], (.8, 1].
PAPER_BINS: tuple[tuple[float, int], ...] = ((0.3, 7), (0.6, 5), (0.8, 3), (1.0, 1))


def check_bins(bins: Sequence[Sequence[float]]) -> tuple[tuple[float, int], ...]:
    """Validate [(upper, size), ...]: increasing uppers ending at 1.0, sizes >= 0."""
    out = tuple((float(u), int(k)) for u, k in bins)
    if not out or any(b[0] >= a[0] for a, b in zip(out[1:], out)) or out[-1][0] < 1.0:
        raise ValueError(f"CAPE bins must be [[upper, size], ...] with increasing uppers ending at 1.0, got {bins}")
    if any(k < 0 for _, k in out):
        raise ValueError("CAPE expansion sizes must be >= 0")
    return out


def expansion_size(confidence: float, bins: Sequence[tuple[float, int]] = PAPER_BINS) -> int:
    """S(p): the size of the first bin whose upper bound is >= p."""
    for upper, k in bins:
        if confidence <= upper:
            return k
    return bins[-1][1]


def add_expansion(tokens: list[int], parents: list[int], parent: int, alternatives: Sequence[int], confidence: float,
                  bins: Sequence[tuple[float, int]], max_rows: int) -> None:
    """CAPE at one position, in place: the first S(confidence) ``alternatives`` (best first) become children of row
    ``parent``, while the tree has fewer than ``max_rows`` rows."""
    for tok in alternatives[:expansion_size(confidence, bins)]:
        if len(tokens) >= max_rows:
            break
        tokens.append(int(tok))
        parents.append(parent)


def cape_tree(root: int, chain: list[int], alternatives: list[list[int]], confidences: list[float],
              bins: Sequence[tuple[float, int]] = PAPER_BINS, max_rows: int = 32,
              chain_q: torch.Tensor | None = None) -> DraftTree:
    """Build the expanded proposal as a draft tree of at most ``max_rows`` rows (root included).

    chain:        x_1..x_gamma (row i + 1 for x_{i+1}, parent row i)
    alternatives: per position, candidate tokens ranked best first (the chain token excluded)
    confidences:  per position, p_i = the drafter's top probability
    chain_q:      optional [gamma, V] distributions the chain tokens were sampled from; expansion rows get zero rows
    Rows: root, the chain, then the expansion sets position by position; past the cap, later (deeper) expansions are
    dropped first, then the end of the chain.
    """
    max_rows = min(max_rows, MAX_TREE_ROWS)
    chain = chain[:max(0, max_rows - 1)]
    tokens, parents = [root, *chain], list(range(-1, len(chain)))
    for i, (alts, p) in enumerate(zip(alternatives[:len(chain)], confidences)):
        # siblings of chain token i + 1: children of the chain row before it
        add_expansion(tokens, parents, i, alts, p, bins, max_rows)
    q = None
    if chain_q is not None:
        q = chain_q.new_zeros(len(tokens), chain_q.shape[-1])
        q[1:1 + len(chain)] = chain_q[:len(chain)]
    return DraftTree(tokens, parents, q)
