"""Decoding with Falcon: its q rows and race order for sampled requests, a cache that holds verified rows only, and
losslessness, on the tiny target and on the default model.

Random-weight checkpoints (tmp dirs) stand in for the trained one, on the tiny random Llama of tests/conftest.py
(fixtures: tests/drafters/conftest.py) where the real model is not needed; `test_shipped_checkpoint_is_lossless_greedy`
needs the shipped checkpoint."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams, race, target_probs, token_clocks
from drafters.base import create_drafter
from drafters.falcon.drafter import FalconDrafter
from drafters.falcon.model import default_checkpoint
from server.engine import Engine, StepPlan
from tests.conftest import chi2_pvalue
from tests.drafters.falcon_tiny import (OPTS, TINY_PROMPTS, V, _random_checkpoint, _reference_model, _start,
                                        _tiny_config, reference_block)
from tests.lossless import accepted_tokens, assert_lossless, tokens_per_step

pytestmark = pytest.mark.usefixtures("_one_thread")  # tests/drafters/conftest.py


# -- sampled requests ---------------------------------------------------------------------------------------------
@pytest.mark.statistical
def test_unseeded_sampled_tree_hands_over_q_and_draws_from_it(tiny_dir, tiny, tiny_ckpt):
    sp = SamplingParams(temperature=0.7, top_k=6)
    drafter = FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=2, width=2, max_rows=32)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    ref = _reference_model(tiny, tiny_ckpt[2])
    torch.manual_seed(0)
    seq = _start(engine, TINY_PROMPTS[0], sp)
    view = engine.view(seq)
    want = torch.zeros(2, V)  # the drafter's q at the two positions after the root, over the whole vocabulary
    want[:, ref.vocab_ids] = target_probs(ref.logits(reference_block(ref, view, [])), sp)
    counts = torch.zeros(V)
    for i in range(300):
        tree = drafter.propose(view)
        tree.validate(V)
        q = tree.q
        assert q is not None and q.shape == (tree.num_rows, V) and not q[0].any()
        assert torch.allclose(q[1:].sum(-1), torch.ones(tree.num_draft), atol=1e-5)
        assert all(q[r, tree.tokens[r]] > 0 for r in range(1, tree.num_rows))
        assert int((q[1:] > 0).sum(-1).max()) <= 6  # shaped like the request: top-k 6
        if i == 0:
            assert tree.num_rows == 1 + 9 + 2 * 9  # two more blocks, under the two likeliest leaves
            assert tree.parents[:10] == [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
            assert torch.allclose(q[1:4], want[0].expand(3, V), atol=1e-5)
            assert torch.allclose(q[4:10], want[1].expand(6, V), atol=1e-5)
        for r in tree.children()[0]:
            counts[tree.tokens[r]] += 1
    # the root's children are independent draws from q (with replacement), fresh at every proposal
    assert chi2_pvalue(counts, want[0]) > 1e-3
    engine.release(seq)


def test_seeded_tree_proposes_race_order_as_point_masses(tiny_dir, tiny, tiny_ckpt):
    """A seeded request's target draws by a race on clocks keyed on (seed, position); Falcon runs the same race on its
    own distribution at each drafted position: the first candidates to ring, under every node alike."""
    sp = SamplingParams(temperature=0.8, top_k=6, seed=11)
    drafter = FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=1)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    ref = _reference_model(tiny, tiny_ckpt[2])
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt, sp)
        view = engine.view(seq)
        tree = drafter.propose(view)
        assert tree.q is None  # point masses: accepted where they equal the target's draws
        q = torch.zeros(2, V)
        q[:, ref.vocab_ids] = target_probs(ref.logits(reference_block(ref, view, [])), sp)
        at = len(seq.token_ids)  # the position of the root's children
        assert tree.tokens[1:4] == race(q[0], token_clocks(sp.seed, at, V), 3)
        assert tree.tokens[4:] == race(q[1], token_clocks(sp.seed, at + 1, V), 2) * 3
        assert drafter.propose(view).tokens == tree.tokens  # a function of the seed, not of a generator
        engine.release(seq)


# -- the cache holds verified rows only ---------------------------------------------------------------------------
def test_cache_catch_up_matches_a_fresh_drafter(tiny_dir, tiny, tiny_ckpt):
    """Greedy generation where some steps draft and some skip the drafter (plain decode steps, as a draft budget
    does): every tree equals the one a fresh drafter proposes from the whole sequence, proposing twice without new
    tokens gives the same tree, and the output is plain decoding's, with drafts accepted."""
    live = FalconDrafter(tiny, tiny_ckpt[2], **OPTS)
    fresh = FalconDrafter(tiny, tiny_ckpt[2], **OPTS)
    engine = Engine(_tiny_config(tiny_dir), live, tiny)
    plain = Engine(_tiny_config(tiny_dir), create_drafter("none", tiny), tiny)
    pattern = [64, 1, 1, 1, 1, 1, 64, 64, 1, 64, 1, 1, 64, 64, 64]  # tree rows allowed per step; 1: no drafting
    accepted = skipped_then_drafted = 0
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt, max_new_tokens=40)
        step = 0
        while seq.finish_reason is None:
            cap = pattern[step % len(pattern)]
            if cap > 1:
                view = engine.view(seq)
                want = fresh.propose(view)
                fresh.release(seq.seq_id)
                got = live.propose(view)
                assert (got.tokens, got.parents) == (want.tokens, want.parents), step
                assert live.propose(view).tokens == got.tokens
                skipped_then_drafted += step > 0 and pattern[(step - 1) % len(pattern)] == 1
            before = seq.stats.accepted_tokens
            engine.run(StepPlan([seq], max_rows={seq.seq_id: cap}))
            accepted += seq.stats.accepted_tokens - before
            step += 1
        assert seq.output_ids == plain.generate(prompt, max_new_tokens=40).token_ids
        engine.release(seq)
    assert accepted > 0 and skipped_then_drafted >= 4


def test_the_tree_depends_on_the_whole_verified_context(tiny_dir, tiny, tiny_ckpt):
    """The power behind the catch-up test: an early token (seen only through the cache) changes the tree."""
    drafter = FalconDrafter(tiny, tiny_ckpt[2], **OPTS)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    trees = []
    for first in (3, 4):
        seq = _start(engine, [first] + TINY_PROMPTS[1][1:])
        trees.append(drafter.propose(engine.view(seq)).tokens)
        engine.release(seq)
    assert trees[0] != trees[1]


def test_lossless_greedy_on_the_tiny_target_with_deep_accepts(tiny_dir, tiny, tiny_ckpt):
    plain = Engine(_tiny_config(tiny_dir), create_drafter("none", tiny), tiny)
    spec = Engine(_tiny_config(tiny_dir), FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 3), forwards=4, width=2,
                                                        max_rows=48), tiny)
    outs = assert_lossless(spec, TINY_PROMPTS + [[5, 5, 5, 5, 5, 5]], plain, 40)
    deep = sum(o.stats.step_tokens - o.stats.verify_steps for o in outs)  # tokens beyond one per step: accepted drafts
    assert deep >= 10


def test_seeded_sampling_is_plain_seeded_decoding_on_the_tiny_target(tiny_dir, tiny, tiny_ckpt):
    """Seeded requests return plain decoding's tokens with that seed, with race-ordered drafts accepted (also off the
    first child); the default model's version (tests/engine/test_seeded_sampling.py) needs the trained head."""
    plain = Engine(_tiny_config(tiny_dir), create_drafter("none", tiny), tiny)
    spec = Engine(_tiny_config(tiny_dir), FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=3, width=2,
                                                        max_rows=32), tiny)
    outs = [out for sp in (SamplingParams(temperature=0.8, top_k=8, seed=5),
                           SamplingParams(temperature=1.0, top_p=0.9, seed=-2))
            for out in assert_lossless(spec, TINY_PROMPTS, plain, 40, sampling=sp, label=sp)]
    assert accepted_tokens(outs) >= 10


# -- the default model (prompt_ids: tests/conftest.py) ------------------------------------------------------------
@pytest.fixture(scope="module")
def random_falcon(target32, tmp_path_factory):
    """An untrained Falcon head for the default target (for contracts, not for acceptance)."""
    return str(_random_checkpoint(target32, tmp_path_factory.mktemp("falcon") / "falcon.safetensors",
                                  vocab_subset=8192, scale=None))


@pytest.mark.slow
def test_random_checkpoint_is_lossless_greedy_deep_tree(fp32_config, target32, prompt_ids, stops, random_falcon):
    plain = Engine(fp32_config, create_drafter("none", target32), target32)
    options = {"checkpoint": random_falcon, "top_m": [3, 2], "forwards": 3, "width": 2, "max_rows": 32}
    spec = Engine(fp32_config, create_drafter("falcon", target32, options), target32)
    for out in assert_lossless(spec, prompt_ids[1:], plain, 33, stops, label=options):
        # full trees were verified (32 rows, root included) while 32 tokens were still wanted, smaller ones after
        assert out.stats.max_draft == 31 and out.stats.draft_tokens >= 300


@pytest.mark.slow
def test_shipped_checkpoint_is_lossless_greedy(fp32_config, target32, stops, prompt_ids):
    assert default_checkpoint(target32.model_id).is_file(), "the trained checkpoint must ship in the repository"
    plain = Engine(fp32_config, create_drafter("none", target32), target32)
    spec = Engine(fp32_config, create_drafter("falcon", target32), target32)
    outs = assert_lossless(spec, prompt_ids, plain, 48, stops, label="falcon")
    assert tokens_per_step(outs) > 1.2  # the trained head really drafts (an untrained one stays near 1.0)
