"""Acceptance rules on hand-built logits: greedy paths, point masses, q-distributions, top-k / top-p shaping."""
from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

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


# -- the rule's exact output distribution, enumerated: every draft token and every random draw ------------------------
class _Outcomes:
    """Runs a function of random draws once per combination of their outcomes, with that combination's probability.

    ``torch.rand`` gives a symbolic uniform u; the rule only compares it, ``u < b`` or ``u * a < b``, and each such
    comparison is a choice between true (probability min(1, b / a)) and false. ``torch.multinomial(p, 1)`` is a
    choice among the indices of p's mass. Choices are made in order along a path (a list of option indices), and
    the paths are walked as an odometer, so every outcome of the function is visited once."""

    def __init__(self):
        self.path: list[int] = []
        self.i, self.prob, self.sizes = 0, 1.0, []

    def choose(self, options: list[tuple[float, object]]):
        options = [(p, v) for p, v in options if p > 0]
        if self.i == len(self.path):
            self.path.append(0)
        p, v = options[self.path[self.i]]
        self.sizes.append(len(options))
        self.i += 1
        self.prob *= p
        return v

    def runs(self, fn):
        """(probability, fn's result) for every outcome of its draws."""
        while True:
            self.i, self.prob, self.sizes = 0, 1.0, []
            result = fn()
            yield self.prob, result
            del self.path[self.i:]
            while self.path and self.path[-1] + 1 == self.sizes[len(self.path) - 1]:
                self.path.pop()
            if not self.path:
                return
            self.path[-1] += 1


class _Uniform:
    def __init__(self, outcomes: _Outcomes, scale: float = 1.0):
        self.outcomes, self.scale = outcomes, scale

    def item(self) -> "_Uniform":
        return self

    def __mul__(self, a: float) -> "_Uniform":
        return _Uniform(self.outcomes, self.scale * float(a))

    def __lt__(self, b: float) -> bool:  # P(u * scale < b), u uniform on [0, 1)
        b = float(b)
        t = 1.0 if self.scale == 0 and b > 0 else 0.0 if self.scale == 0 else min(1.0, max(0.0, b / self.scale))
        return self.outcomes.choose([(t, True), (1.0 - t, False)])


class _EnumeratedTorch:
    """torch for the module under test, with its random draws enumerated by ``outcomes``."""

    def __init__(self, outcomes: _Outcomes):
        self.outcomes = outcomes

    def rand(self, *args, **kwargs):
        return _Uniform(self.outcomes)

    def multinomial(self, p, num_samples, generator=None):
        p = p.double() / p.double().sum()
        return torch.tensor([self.outcomes.choose([(float(p[i]), i) for i in range(len(p))])])

    def __getattr__(self, name):
        return getattr(torch, name)


EV = 4  # the enumeration's vocabulary


def _row(key: tuple, temperature: float, zeros: int = 0) -> torch.Tensor:
    """A distribution over EV tokens fixed by ``key`` (a path and what it is for), with ``zeros`` tokens of none."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    logits = torch.randn(EV, generator=g) / temperature
    if zeros:
        logits[torch.randperm(EV, generator=g)[:zeros]] = -math.inf
    return torch.softmax(logits, -1)


# trees as (parent, kind) per node after the root: "q" a token drawn from the node's own q row, an int a point mass
TREES = {
    "q_children": [(0, "q"), (0, "q"), (1, "q"), (3, "q")],
    "point_masses": [(0, 1), (0, 2), (0, 3), (1, 0), (4, 2)],
    "mixed": [(0, "q"), (0, 2), (0, "q"), (1, 1), (1, "q"), (4, "q"), (3, 3)],
}


def exact_outputs(parents_kinds, p_of, q_of, accept=None, reported=None) -> tuple[dict, dict]:
    """(the rule's distribution, the target's) over the first L tokens: L = the tree's depth + 1, the rule's output
    continued by plain sampling from p where it stopped short. Enumerates every draft token (each sampled node's
    token drawn from its q row given its path) and every draw of the rule. ``reported``: the q row the tree carries
    for a drawn one (default: the same row)."""
    import server.engine.acceptance as acceptance

    accept = accept or acceptance.accept_sampling
    parents = [-1] + [pk[0] for pk in parents_kinds]
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    L = max(depth) + 1
    sampled = [i for i, (_, kind) in enumerate(parents_kinds, 1) if kind == "q"]

    def path(tokens, i):  # the tokens from the root's first child down to node i
        out = []
        while i > 0:
            out.append(tokens[i])
            i = parents[i]
        return tuple(reversed(out))

    target = {}
    for seq in itertools.product(range(EV), repeat=L):
        pr = 1.0
        for j in range(L):
            pr *= float(p_of(seq[:j])[seq[j]])
        target[seq] = pr
    got = dict.fromkeys(target, 0.0)
    for draft in itertools.product(range(EV), repeat=len(sampled)):
        tokens = [0] + [kind if kind != "q" else 0 for _, kind in parents_kinds]
        q = torch.zeros(len(parents), EV)
        w = 1.0
        for i, x in zip(sampled, draft):
            tokens[i] = x
            q[i] = q_of(path(tokens, parents[i]), i)
            w *= float(q[i][x])
        if w == 0:
            continue
        tree = DraftTree(tokens, parents, (q if reported is None else reported(q)) if sampled else None)
        probs = torch.stack([p_of(path(tokens, i)) for i in range(len(parents))])
        outcomes = _Outcomes()
        real = acceptance.torch
        acceptance.torch = _EnumeratedTorch(outcomes)
        try:
            for pr, (_, out) in outcomes.runs(lambda: accept(tree, probs, None)):
                for rest in itertools.product(range(EV), repeat=L - len(out)):
                    seq = tuple(out) + rest
                    cont = 1.0
                    for j in range(len(out), L):
                        cont *= float(p_of(seq[:j])[seq[j]])
                    got[seq] += w * pr * cont
        finally:
            acceptance.torch = real
    return got, target


def _max_gap(case: str, zeros: int = 0, **kwargs) -> float:
    got, target = exact_outputs(TREES[case], lambda path: _row(("p", path), 0.8, zeros),
                                lambda path, node: _row(("q", path, node), 0.6), **kwargs)
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-6)
    return max(abs(got[k] - target[k]) for k in target)


@pytest.mark.parametrize("case", sorted(TREES))
@pytest.mark.parametrize("zeros", [0, 1], ids=["full", "p_with_zeros"])
def test_sampling_rule_output_is_exactly_the_target(case, zeros):
    """Every draft token and every draw of the rule enumerated on a 4-token vocabulary: the first L tokens it emits
    (continued by plain sampling where it stops) have exactly the target's probabilities (siblings drawn from their
    own q rows, point masses, deep chains; p with a token of no mass, which q still drafts)."""
    assert _max_gap(case, zeros) < 1e-6


def _accept_first_children(tree, probs, generator):
    """A broken rule: the first child taken all the way down, the bonus drawn from p at the leaf."""
    import server.engine.acceptance as acceptance

    children, rows, node = tree.children(), [0], 0
    while children[node]:
        node = children[node][0]
        rows.append(node)
    bonus = int(acceptance.torch.multinomial(probs[node], 1, generator=generator).item())
    return rows, [tree.tokens[r] for r in rows[1:]] + [bonus]


@pytest.mark.parametrize("bug", ["bonus from p", "q misreported", "first children"])
def test_negative_control_exact_enumeration_catches_broken_rules(bug, monkeypatch):
    """The residual left as the node's whole p (the classic bug); a drafter reporting q**1.25 renormalised for
    tokens drawn from q (a mild misreport a chi-square of thousands of draws hardly sees); the first child accepted
    all the way down. Each leaves the target's distribution by far more than round-off. (Drafts from q accepted as
    point masses, with p(x), would not be a bug: that rule is lossless for any draft distribution.)"""
    import server.engine.acceptance as acceptance

    kwargs = {}
    if bug == "bonus from p":
        monkeypatch.setattr(acceptance, "residual", lambda left, p_node, rejected: p_node)
    elif bug == "q misreported":
        kwargs["reported"] = lambda q: q ** 1.25 / (q ** 1.25).sum(-1, keepdim=True).clamp(min=1e-30)
    else:
        kwargs["accept"] = _accept_first_children
    assert _max_gap("mixed", **kwargs) > 1e-3


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
