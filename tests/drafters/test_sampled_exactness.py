"""Sampled exactness through every real drafter's own sampling code (tiny random Llama target, random drafter weights).

For each registered drafter but `none`, an Engine on the tiny random target (float32, CPU) runs the drafter the
registry builds from a config -- its own prefill / propose / observe code -- with randomly initialised weights where
it has a model: a random GLIDE network (also the cascade's reviewer) and a random Falcon head, each over a random
subset of the vocabulary, and a random Max-Gram bigram table. Each case samples K tokens after a prompt from many
independent requests at temperature > 0, some with top-k / top-p. The drafter's quality does not matter; its code
path does. Requests without a seed go through speculative sampling's rejection rule (each request's random state
fixed by seeding torch's global generator before it, so a run is reproducible); requests with a seed go through the
race keyed on (seed, position) that makes them token-exact (``core.sampling``): through a drafter they are tested
token for token against plain seeded decoding, whose distribution is tested once, with a control that reuses one
position's clocks at every position.

The reference is computed without the code under test: transformers' own LlamaForCausalLM forward on the same saved
weights (float64), this file's own temperature -> top-k -> top-p (vLLM's order, from the definitions), and every one
of the V**K continuations enumerated. A chi-square test compares the sampled K-token sequences with it.

The draws must go through the speculative path, not only the bonus token: every case asserts that drafts were
proposed and accepted, also at depth 2, and, where the drafter makes them, that its trees carried draft
distributions q and sibling branches and that a non-first sibling was accepted. Negative controls (power): with
acceptance broken to take the first child all the way down, the same check fails for every drafter; and the subtler
classic bug (a rejection leaves p as it was: later siblings and the bonus see p, not the residual) fails it too,
through glide-cape, whose trees hold both q rows and point-mass siblings. Every case runs as served: 8 requests with
different trees (and, at a batch's end, fewer) share every target forward.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import core.sampling as sampling_module
import drafters.glide.drafter as glide_module
import server.engine.acceptance as acceptance_module
import server.engine.engine as engine_module
from core.sampling import SamplingParams
from drafters.base import drafter_names
from server.engine import Engine
from tests.conftest import chi2_pvalue
from tests.drafters.exactness import (  # noqa: F401 (reference_logits, target, weight_files: fixtures)
    CASES, N, N_CONTROL, SEED_ORDER, SEED_STRIDE, Coverage, _config, accept_first_children,
    accept_without_residual, make_engine, outputs, recording, reference_joint, reference_logits, sample_joint,
    seed_base, target, weight_files)

from tests.drafters import exactness

pytestmark = pytest.mark.statistical
if exactness.WIDE:
    tiny_dir = exactness.tiny_dir  # the wider tiny target (a GPU run)


# -- the tests ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_sampling_through_the_drafter_matches_the_target(name, tiny_dir, target, weight_files, reference_logits,
                                                         monkeypatch):
    case = CASES[name]
    engine = make_engine(tiny_dir, target, weight_files, name)
    cov = Coverage()
    monkeypatch.setattr(engine_module, "accept_sampling", recording(engine_module.accept_sampling, cov))
    t0 = time.perf_counter()
    counts = sample_joint(engine, case.sampling, N, seed_base(name))
    pvalue = chi2_pvalue(counts, reference_joint(reference_logits, case.sampling))
    print(f"\n{name}: p = {pvalue:.4g} over {N} requests in {time.perf_counter() - t0:.1f} s; {cov}")
    # the speculative path really ran: drafts proposed and accepted, also two deep (rare for `ngram`, whose most recent
    # match here sits near the end of the text, so its drafts are mostly one token long)
    assert cov.draft_rows >= cov.steps // 2 and cov.accepted >= N // 20 and cov.deep_accepts > 0, cov
    if "q" in case.expects:  # sampled chain tokens come with the distribution they were drawn from
        assert cov.q_rows >= cov.steps, cov
    if "siblings" in case.expects:  # trees branch, and acceptance goes past a rejected first child
        assert cov.sibling_trees >= cov.steps // 2 and cov.later_sibling_accepts >= N // 100, cov
    if "lengths" in case.expects:  # the draft length varies from step to step
        assert len(cov.draft_lengths) >= 2, cov
    assert pvalue > 1e-3, f"{name}: sampled continuations do not follow the target's distribution (p = {pvalue:.3g})"


@pytest.mark.parametrize("name", sorted(CASES))
def test_negative_control_accepting_first_children_is_caught(name, tiny_dir, target, weight_files, reference_logits,
                                                             monkeypatch):
    """If the drafts were never proposed, or never reached the output, this broken rule would pass unnoticed."""
    case = CASES[name]
    engine = make_engine(tiny_dir, target, weight_files, name)
    monkeypatch.setattr(engine_module, "accept_sampling", accept_first_children)
    counts = sample_joint(engine, case.sampling, N_CONTROL, seed_base(name, control=1))
    joint = reference_joint(reference_logits, case.sampling)
    impossible = int(counts[joint == 0].sum())
    if impossible:  # drafted tokens the target never samples (top-k / top-p): chi2_pvalue fails on them outright
        with pytest.raises(AssertionError, match="probability zero"):
            chi2_pvalue(counts, joint)
    pvalue = chi2_pvalue(counts * (joint > 0), joint)  # and the chi-square alone, on the other continuations
    print(f"\n{name} (first children): p = {pvalue:.3g}; {impossible} of {N_CONTROL} with target probability 0")
    assert pvalue < 1e-6


def test_negative_control_bonus_from_p_instead_of_the_residual_is_caught(tiny_dir, target, weight_files,
                                                                         reference_logits, monkeypatch):
    """The classic bug, subtler than the above: rejections never update p, so later siblings and the bonus token see
    the node's whole distribution instead of the residual (through q rows and point-mass siblings alike)."""
    name = "glide-cape"
    monkeypatch.setattr(engine_module, "accept_sampling", accept_without_residual)
    engine = make_engine(tiny_dir, target, weight_files, name)
    sp = CASES[name].sampling
    counts = sample_joint(engine, sp, N_CONTROL, seed_base(name, control=2))
    pvalue = chi2_pvalue(counts, reference_joint(reference_logits, sp))
    print(f"\n{name} (no residual): p = {pvalue:.3g}")
    assert pvalue < 1e-6


SEEDED_REQUESTS = 240  # seeds per drafter compared token for token with plain seeded decoding
SEEDED_TOKENS = 8     # tokens compared per seed


def seeded_tokens(engine: Engine, sp: SamplingParams, seeds: list[int]) -> list[list[int]]:
    return outputs(engine, sp, seeds, seeded=True, k=SEEDED_TOKENS)


@pytest.mark.parametrize("name", ["glide-cape", "cascade", "falcon"])  # race-ordered candidates and siblings
def test_seeded_sampling_through_the_drafter_is_plain_seeded_decoding(name, tiny_dir, target, weight_files,
                                                                      monkeypatch):
    """Seeded requests are token-exact by design: the race keyed on (seed, position) picks the target's token whatever
    was drafted, and drafts are accepted only where they equal it. So through the drafter each seed gives plain
    seeded decoding's tokens, token for token (a stronger check than a chi-square of the two: any draw that differs
    fails); the next test checks plain seeded decoding's distribution against the reference."""
    case = CASES[name]
    engine = make_engine(tiny_dir, target, weight_files, name)
    plain = Engine(_config(tiny_dir), target=target)
    cov = Coverage()
    monkeypatch.setattr(engine_module, "accept_seeded", recording(engine_module.accept_seeded, cov))
    seeds = [seed_base(name, control=6) + i * SEED_STRIDE for i in range(SEEDED_REQUESTS)]
    got, want = seeded_tokens(engine, case.sampling, seeds), seeded_tokens(plain, case.sampling, seeds)
    assert [s for s, a, b in zip(seeds, got, want) if a != b] == [], name  # no seed differs
    print(f"\n{name} seeded: {SEEDED_REQUESTS} seeds equal plain seeded decoding; {cov}")
    # the speculative path really ran: drafts accepted, also two deep, and past a rejected first child
    assert cov.accepted >= SEEDED_REQUESTS and cov.deep_accepts > 0 and cov.later_sibling_accepts > 0, cov


@pytest.mark.parametrize("name", ["glide-cape", "cascade", "falcon"])
def test_negative_control_seeded_drafts_accepted_unequal_to_the_race_are_caught(name, tiny_dir, target,
                                                                               weight_files, monkeypatch):
    """A broken seeded rule that takes the first child at every node: its tokens leave plain seeded decoding's."""
    engine = make_engine(tiny_dir, target, weight_files, name)
    plain = Engine(_config(tiny_dir), target=target)
    sp = CASES[name].sampling
    monkeypatch.setattr(engine_module, "accept_seeded", lambda tree, probs, *a: accept_first_children(
        tree, probs, torch.Generator().manual_seed(0)))
    seeds = [seed_base(name, control=6) + i * SEED_STRIDE for i in range(40)]
    differ = sum(a != b for a, b in zip(seeded_tokens(engine, sp, seeds), seeded_tokens(plain, sp, seeds)))
    assert differ >= 10, differ


def test_plain_seeded_decoding_matches_the_target(tiny_dir, target, reference_logits):
    """The race keyed on (seed, position) samples the target's distribution: plain seeded decoding, every case's
    shaping that the seeded cases above use, N seeds."""
    plain = Engine(_config(tiny_dir), target=target)
    sp = CASES["glide-cape"].sampling
    counts = sample_joint(plain, sp, N, seed_base("glide-cape", control=6), seeded=True)
    pvalue = chi2_pvalue(counts, reference_joint(reference_logits, sp))
    print(f"\nplain seeded: p = {pvalue:.4g}")
    assert pvalue > 1e-3, f"seeded sampling does not follow the target's distribution (p = {pvalue:.3g})"


def test_negative_control_seeded_clocks_reused_across_positions_are_caught(tiny_dir, target, reference_logits,
                                                                           monkeypatch):
    """Clocks keyed on the seed alone (every position of a request runs the same race): each token alone still
    follows its marginal, but successive tokens are no longer independent draws."""
    real = sampling_module.token_clocks
    for module in (sampling_module, engine_module, acceptance_module, glide_module):
        monkeypatch.setattr(module, "token_clocks", lambda seed, position, vocab: real(seed, 0, vocab))
    plain = Engine(_config(tiny_dir), target=target)
    sp = CASES["glide-cape"].sampling
    counts = sample_joint(plain, sp, N_CONTROL, seed_base("glide-cape", control=7), seeded=True)
    assert chi2_pvalue(counts, reference_joint(reference_logits, sp)) < 1e-6


def test_every_registered_drafter_has_a_case():
    """New drafters join this test as they land: each needs a Case (options with random weights) above."""
    missing = sorted(set(drafter_names()) - {"none"} - set(CASES))
    assert not missing, f"drafters without a sampled-exactness case in {Path(__file__).name}: {missing}"
    assert set(CASES) <= set(drafter_names()), "a case for a drafter that is no longer registered"
    assert sorted(SEED_ORDER) == sorted(CASES), "each case needs its place in SEED_ORDER (new ones at the end)"
