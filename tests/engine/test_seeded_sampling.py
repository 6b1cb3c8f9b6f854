"""A seeded sampled request returns the tokens plain decoding samples with that seed, token for token: with every
drafter, with deep accepted tree paths, in a batch, and whether or not the draft budget lets it draft (default model,
float32). That the draws follow the target's distribution is tests/drafters/test_sampled_exactness.py's part."""
from __future__ import annotations

import random

import pytest

from core.sampling import SamplingParams
from drafters.base import create_drafter
from server.engine import Engine, StepPlan
from tests.engine.tree_drafters import OracleTreeDrafter
from tests.lossless import accepted_tokens, assert_lossless, plain_tokens

PROMPTS = [
    ("chat", "Tell me a short story about a lighthouse keeper."),
    ("chat", "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"),
]
SAMPLINGS = [SamplingParams(temperature=0.8, top_p=0.95, seed=7), SamplingParams(temperature=1.0, top_k=40, seed=-3)]
MAX_NEW = 32


@pytest.fixture(scope="module")
def plain(fp32_config, target32, prompts, stops):
    """{sampling: [tokens per prompt]} sampled by plain decoding."""
    engine = Engine(fp32_config, target=target32)
    return {sp: plain_tokens(engine, prompts, MAX_NEW, stops, sp) for sp in SAMPLINGS}


def test_plain_seeded_decoding_is_reproducible_and_depends_on_the_seed(fp32_config, target32, prompts, stops, plain):
    engine = Engine(fp32_config, target=target32)
    sp, p = SAMPLINGS[0], prompts[0]
    assert engine.generate(p, sp, MAX_NEW, stops).token_ids == plain[sp][0]
    other = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed + 1)
    assert engine.generate(p, other, MAX_NEW, stops).token_ids != plain[sp][0]


@pytest.mark.parametrize("name,options", [("ngram", {"num_tokens": 6}), ("glide", {}), ("glide-cape", {}),
                                          ("cascade", {}), ("falcon", {})])
def test_every_drafter_samples_what_plain_decoding_samples(fp32_config, target32, prompts, stops, plain, name,
                                                           options):
    engine = Engine(fp32_config, create_drafter(name, target32, options), target32)
    outs = [out for sp in SAMPLINGS for out in assert_lossless(engine, prompts, plain[sp], MAX_NEW, stops, sp,
                                                               label=(name, sp))]
    assert accepted_tokens(outs) > 0  # drafts were accepted, so the speculative path produced some of these tokens


def test_deep_tree_paths_in_a_batch_with_drafting_on_and_off(fp32_config, target32, prompts, stops, plain):
    """Two seeded requests share every step; each step a random choice lets each draft a random tree that hides
    the true continuation (accepted deep, off the first child) or take a plain decode step, as the budget does."""
    reference = {tuple(p): plain[SAMPLINGS[i]][i] for i, p in enumerate(prompts)}
    drafter = OracleTreeDrafter(reference, max_rows=64, vocab_size=target32.args.vocab_size)
    engine = Engine(fp32_config, drafter, target32)
    rng = random.Random(0)
    seqs = [engine.add(p, SAMPLINGS[i], MAX_NEW, stops) for i, p in enumerate(prompts)]
    engine.run(StepPlan(prefill=[(s, s.prompt_len) for s in seqs]))
    steps = 0
    while any(s.finish_reason is None for s in seqs):
        live = [s for s in seqs if s.finish_reason is None]
        engine.run(StepPlan(live, max_rows={s.seq_id: rng.choice([1, 64]) for s in live}))
        steps += 1
    for i, s in enumerate(seqs):
        assert s.output_ids == plain[SAMPLINGS[i]][i]
        engine.release(s)
    assert steps < 0.8 * max(s.num_generated for s in seqs)  # deep paths were accepted
