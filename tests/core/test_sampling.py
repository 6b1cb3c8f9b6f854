"""Sampling parameters: tiny temperatures decode greedily instead of overflowing."""
from __future__ import annotations

import pytest
import torch

from core.sampling import GREEDY_TEMPERATURE, SamplingParams, target_probs
from server.config import config_from_dict
from server.engine import Engine


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
    engine = Engine(cfg)
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
