"""Acceptance rules on hand-built logits: greedy paths, point masses, q-distributions, top-k / top-p shaping."""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from core.sampling import SamplingParams, target_probs
from core.tree import DraftTree
from server.engine.acceptance import accept_greedy, accept_sampling, residual

V = 8


def one_hot_logits(best: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(best), V)
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits


def test_greedy_follows_argmax_through_second_child():
    #        0(root)
    #       /   \
    #     1:a    2:b
    #     |       |  \
    #    3:c    4:d  5:e
    tree = DraftTree([7, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2, 2])
    rows, toks = accept_greedy(tree, one_hot_logits([2, 0, 5, 0, 0, 6]))
    assert rows == [0, 2, 5] and toks == [2, 5, 6]  # bonus = argmax at row 5


def test_greedy_stops_at_first_miss_and_emits_bonus():
    tree = DraftTree.chain(7, [1, 2, 3])
    rows, toks = accept_greedy(tree, one_hot_logits([1, 4, 0, 0]))
    assert rows == [0, 1] and toks == [1, 4]
    rows, toks = accept_greedy(DraftTree.root_only(3), one_hot_logits([6]))
    assert rows == [0] and toks == [6]


def test_greedy_whole_chain_accepted_gets_bonus_from_leaf():
    tree = DraftTree.chain(7, [1, 2, 3])
    rows, toks = accept_greedy(tree, one_hot_logits([1, 2, 3, 4]))
    assert rows == [0, 1, 2, 3] and toks == [1, 2, 3, 4]


def test_point_mass_certain_and_impossible():
    g = torch.Generator().manual_seed(0)
    probs = torch.zeros(3, V)
    probs[0, 2] = 1.0   # root: certainly token 2
    probs[1, 5] = 1.0   # after row 1: certainly token 5
    probs[2, 3] = 1.0
    tree = DraftTree([0, 2, 6], [-1, 0, 1])  # row 2 proposes 6, impossible under p
    for _ in range(50):
        rows, toks = accept_sampling(tree, probs, g)
        assert rows == [0, 1] and toks == [2, 5]  # 6 rejected, residual = point mass on 5


def test_rejected_point_mass_is_never_the_bonus():
    g = torch.Generator().manual_seed(1)
    probs = torch.full((2, V), 1.0 / V)
    tree = DraftTree([0, 3], [-1, 0])
    seen_bonus = set()
    for _ in range(400):
        rows, toks = accept_sampling(tree, probs, g)
        if rows == [0]:
            seen_bonus.add(toks[0])
    assert 3 not in seen_bonus and len(seen_bonus) == V - 1


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability zero"
    return stats.chisquare(counts[keep].double().numpy(), (probs[keep].double() * n).numpy()).pvalue


@pytest.mark.statistical
@pytest.mark.parametrize("case", ["q_children", "point_masses", "mixed"])
def test_first_token_distribution_is_exact(case):
    """One level of siblings: the emitted first token is distributed exactly as p (20k draws, chi-square)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(123)
    p = torch.softmax(torch.randn(V) * 1.5, -1)
    n_children, N = 3, 20_000
    counts = torch.zeros(V)
    for _ in range(N):
        q = torch.zeros(n_children + 1, V)
        tokens = [0]
        for c in range(1, n_children + 1):
            if case == "q_children" or (case == "mixed" and c % 2):
                q[c] = torch.softmax(torch.randn(V, generator=g) * 2, -1)
                tokens.append(int(torch.multinomial(q[c], 1, generator=g)))
            else:
                tokens.append(int(torch.randint(V, (), generator=g)))
        tree = DraftTree(tokens, [-1] + [0] * n_children, q)
        probs = torch.stack([p] * (n_children + 1))
        _, toks = accept_sampling(tree, probs, g)
        counts[toks[0]] += 1
    assert _chi2_p(counts, p) > 1e-3


def test_target_probs_top_k_top_p_temperature():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    full = torch.softmax(logits / 0.5, -1)
    p = target_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(p, full)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (p[0, 3:] == 0).all() and math.isclose(p.sum().item(), 1.0, rel_tol=1e-6)
    torch.testing.assert_close(p[0, :3], torch.softmax(logits[0, :3], -1))
    # top_p keeps the smallest prefix whose mass reaches top_p
    base = torch.softmax(logits, -1)[0]
    cut = 0.8
    k = int((torch.cumsum(base, 0) < cut).sum()) + 1
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=cut))
    assert (p[0, :k] > 0).all() and (p[0, k:] == 0).all()


def test_sampling_params_validation():
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
                dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_empty_residual_never_brings_back_a_rejected_token():
    """Round-off can leave no mass after a rejection (p == q on q's support); the fallback must still exclude every
    token already rejected at that node."""
    p_node = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0])
    # a q-child on token 0 with q == p was "rejected", then a point mass on token 1: nothing left in max(p - q, 0)
    out = residual(torch.zeros(V), p_node, rejected=[0, 1])
    assert out[0] == 0 and out[1] == 0
    torch.testing.assert_close(out, torch.tensor([0, 0, 1.0, 0, 0, 0, 0, 0]))
    # the ordinary case just normalises
    torch.testing.assert_close(residual(torch.tensor([0, 0.2, 0.2, 0, 0, 0, 0, 0]), p_node, [0]),
                               torch.tensor([0, 0.5, 0.5, 0, 0, 0, 0, 0]))
    with pytest.raises(RuntimeError, match="no target mass"):
        residual(torch.zeros(V), p_node, rejected=[0, 1, 2])
