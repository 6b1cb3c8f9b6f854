"""DraftTree.validate checks the contract sampled exactness rests on (core/tree.py's module docstring)."""
from __future__ import annotations

import pytest
import torch

from core.tree import DraftTree

V = 8


def dist(*mass: tuple[int, float]) -> torch.Tensor:
    row = torch.zeros(V)
    for tok, p in mass:
        row[tok] = p
    return row


def q_rows(*rows: torch.Tensor | None) -> torch.Tensor:
    """Stack q rows; None = a point mass (all zero). Row 0 (the root) is added."""
    return torch.stack([torch.zeros(V), *[torch.zeros(V) if r is None else r for r in rows]])


def test_a_cape_shaped_tree_passes():
    # root -> x1 (sampled) -> x2 (sampled); alternatives of x1 and x2 as point masses after them
    tree = DraftTree([0, 3, 4, 5, 6, 7], [-1, 0, 1, 0, 0, 1],
                     q_rows(dist((3, 0.5), (5, 0.5)), dist((4, 1.0)), None, None, None))
    tree.validate(V)
    DraftTree.chain(0, [1, 2]).validate(V)  # q=None: point masses
    DraftTree([0, 1, 2], [-1, 0, 0], q_rows(dist((1, 0.25), (2, 0.75)), dist((2, 1.0)))).validate(V)  # 2 sampled


def test_q_row_must_be_a_distribution():
    with pytest.raises(ValueError, match="sums to"):
        DraftTree.chain(0, [3], q_rows(dist((3, 0.5)))).validate(V)
    with pytest.raises(ValueError, match="sums to"):
        DraftTree.chain(0, [3], q_rows(dist((3, 0.9), (4, 0.3)))).validate(V)
    with pytest.raises(ValueError, match="non-negative"):
        DraftTree.chain(0, [3], q_rows(dist((3, 1.5), (4, -0.5)))).validate(V)
    with pytest.raises(ValueError, match="finite"):
        DraftTree.chain(0, [3], q_rows(dist((3, float("nan"))))).validate(V)


def test_sampled_token_needs_q_above_zero():
    with pytest.raises(ValueError, match="q = 0"):
        DraftTree.chain(0, [3], q_rows(dist((4, 1.0)))).validate(V)


def test_sampled_sibling_after_a_point_mass_is_rejected():
    # row 1 is a point mass (e.g. a CAPE alternative), row 2 a sampled sibling after it: acceptance would try the
    # alternative first, while the alternative was chosen knowing the sampled token
    tree = DraftTree([0, 5, 3], [-1, 0, 0], q_rows(None, dist((3, 0.5), (5, 0.5))))
    with pytest.raises(ValueError, match="sampled siblings must come first"):
        tree.validate(V)
    # the same rows under different parents are fine: they are not siblings
    DraftTree([0, 5, 3], [-1, 0, 1], q_rows(None, dist((3, 0.5), (5, 0.5)))).validate(V)


def test_q_shape_is_checked():
    with pytest.raises(ValueError, match="shape"):
        DraftTree.chain(0, [3], torch.zeros(2, V + 1)).validate(V)


def test_depth_first_keeps_each_first_child_under_its_parent_and_the_sibling_order():
    # Falcon's top_m [2, 1] then a chain, in the order it drafts: x1 x2 | y1 (under x1) y2 (under x2) | z1 z2
    q = torch.stack([torch.full((V,), float(i)) for i in range(7)])
    tree = DraftTree([0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 2, 3, 5], q)
    dfs = tree.depth_first()
    assert dfs.tokens == [0, 1, 3, 5, 6, 2, 4]  # root x1 y1 z1 z2: one chain first, then the branch x2 y2
    assert dfs.parents == [-1, 0, 1, 2, 3, 0, 5]
    assert dfs.q[:, 0].tolist() == [0, 1, 3, 5, 6, 2, 4]  # q rows travel with their tokens
    assert [[dfs.tokens[c] for c in kids] for kids in dfs.children()][0] == [1, 2]  # siblings keep their order
    chain = DraftTree.chain(0, [1, 2])
    assert chain.depth_first() is chain  # already depth-first: the same tree
    cape = DraftTree([0, 3, 4, 5, 6, 7], [-1, 0, 1, 0, 0, 1])
    assert cape.depth_first().tokens == [0, 3, 4, 7, 5, 6]
