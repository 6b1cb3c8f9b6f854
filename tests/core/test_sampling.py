"""Sampling parameters: tiny temperatures decode greedily instead of overflowing."""
from __future__ import annotations

import pytest
import torch

from core.sampling import GREEDY_TEMPERATURE, SamplingParams, target_probs
from server.config import config_from_dict
from server.engine import load_engine


@pytest.mark.parametrize("t", [0.0, 1e-38, 5e-324, 1e-300, 1e-6])
def test_tiny_temperatures_are_greedy(t):
    assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


@pytest.mark.parametrize("t", [float("inf"), float("nan"), -1e-38])
def test_non_finite_or_negative_temperature_is_refused(t):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=t)


def test_target_probs_refuses_a_greedy_request():
    with pytest.raises(ValueError, match="greedily"):
        target_probs(torch.zeros(1, 4), SamplingParams(temperature=1e-38))


def test_engine_decodes_tiny_temperatures_greedily(tiny_dir):
    cfg = config_from_dict({"model": {"source": str(tiny_dir), "dtype": "float32", "device": "cpu"},
                            "cache": {"num_slots": 1, "max_seq_len": 32}, "drafter": {"name": "ngram"}})
    engine = load_engine(cfg)
    greedy = engine.generate([2, 3, 4, 2, 3], max_new_tokens=8).token_ids
    for t in (1e-38, 5e-324, 1e-7):
        out = engine.generate([2, 3, 4, 2, 3], SamplingParams(temperature=t, top_p=0.5, top_k=3, seed=1),
                              max_new_tokens=8)
        assert out.token_ids == greedy


def test_drafter_streams_are_not_other_requests_acceptance_streams():
    from core.sampling import request_generator

    def draws(seed, offset):
        g = request_generator(SamplingParams(temperature=1.0, seed=seed), torch.device("cpu"), offset)
        return torch.rand(8, generator=g)

    assert torch.equal(draws(5, 1), draws(5, 1))  # seeded: reproducible
    for offset in (1, 2):
        assert not torch.equal(draws(5, offset), draws(5 + offset, 0))
        assert not torch.equal(draws(5, offset), draws(5, 0))


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-45, 1e-9])
def test_tiny_top_p_keeps_the_most_likely_token(top_p):
    """top_p below float32's smallest value rounds to 0 in the comparison; the best token must still be kept."""
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


# -- shaping: logit_bias, penalties, min_p (the rest of vLLM's order) ---------------------------------------------------
def _reference_shaped(logits, sp: SamplingParams, prompt, generated):
    """From the definitions, in float64: bias, then the repetition penalty on every token of prompt + generated,
    then frequency x count and presence x [count > 0] over the generated tokens."""
    x = logits.double().clone()
    for t, b in sp.logit_bias:
        x[t] += b
    seen = set(prompt) | set(generated)
    for t in range(x.shape[0]):
        if t in seen and sp.repetition_penalty != 1.0:
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
        c = generated.count(t)
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty * (c > 0)
    return x


SHAPINGS = {
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition<1": SamplingParams(repetition_penalty=0.6),
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=-0.8),
    "bias": SamplingParams(logit_bias=((3, -100.0), (7, 2.5))),
    "all": SamplingParams(presence_penalty=0.4, frequency_penalty=-0.3, repetition_penalty=1.2,
                          logit_bias=((0, 1.0), (9, -3.0))),
}


@pytest.mark.parametrize("name", sorted(SHAPINGS))
def test_shaper_follows_the_definitions(name):
    from core.sampling import Shaper

    sp = SHAPINGS[name]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, generator=g) * 3
    prompt, generated = [1, 2, 2, 5], [5, 7, 7, 7, 9]
    shaper = Shaper(sp, prompt, 12, "cpu")
    shaper.append(generated)
    want = _reference_shaped(logits, sp, prompt, generated)
    assert torch.allclose(shaper(logits).double(), want, atol=1e-5), (shaper(logits), want)


@pytest.mark.parametrize("name", sorted(SHAPINGS))
def test_a_path_shapes_a_row_as_committing_it_would(name):
    """Shaping with drafted tokens on the path is bitwise shaping after committing them: a tree row sees what plain
    decoding sees at that position."""
    from core.sampling import Shaper

    sp = SHAPINGS[name]
    logits = torch.randn(12, generator=torch.Generator().manual_seed(1)) * 3
    prompt, committed, path = [4, 4, 8], [8, 1], [1, 6, 6]
    tree_view = Shaper(sp, prompt, 12, "cpu")
    tree_view.append(committed)
    plain = Shaper(sp, prompt, 12, "cpu")
    plain.append(committed + path)
    assert torch.equal(tree_view(logits, path), plain(logits))
    fresh = Shaper(sp, prompt, 12, "cpu")  # and the path left the committed state as it was
    fresh.append(committed)
    assert torch.equal(tree_view(logits), fresh(logits))


def test_min_p_drops_tokens_below_a_fraction_of_the_best_after_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))  # keep p >= 0.1
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.12, 0.0]]) / 0.92)
    p = target_probs(logits, SamplingParams(temperature=0.5, min_p=0.2))  # sharper: 0.12 falls below 0.2 x max
    assert p[0, 2] == 0 and p[0, 1] > 0
    assert torch.equal(target_probs(logits, SamplingParams(temperature=1.0, min_p=1.0)),
                       torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.5}, {"frequency_penalty": -2.01},
                                {"repetition_penalty": 0.0}, {"repetition_penalty": float("inf")},
                                {"min_p": 1.5}, {"min_p": -0.1}, {"logit_bias": ((1, 100.5),)},
                                {"logit_bias": ((-1, 1.0),)}, {"logit_bias": tuple((i, 1.0) for i in range(301))},
                                {"logprobs": 21}, {"prompt_logprobs": -1}])
def test_shaping_values_out_of_range_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_a_bias_for_a_token_outside_the_vocabulary_is_refused():
    from core.sampling import Shaper

    with pytest.raises(ValueError, match="vocabulary"):
        Shaper(SamplingParams(logit_bias=((12, 1.0),)), [1], 12, "cpu")
