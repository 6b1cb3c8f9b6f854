"""Speculative sampling through the real engine matches the target distribution (tiny random Llama), the runs
stepped 32 at a time as a served batch is.

For a fixed context, the joint distribution of the next two tokens under speculative sampling with random trees
and random draft distributions q must equal p(t1) * p(t2 | t1) computed exactly from the model. A broken
acceptance rule (sampling the bonus from p instead of the residual) must fail the same test: the negative control.
"""
from __future__ import annotations

import pytest
import torch

import server.engine.acceptance as acceptance
from core.sampling import SamplingParams, target_probs
from core.tree import DraftTree
from server.config import config_from_dict
from server.engine import Engine, load_engine
from server.engine.step import StepPlan
from tests.conftest import chi2_pvalue
from tests.engine.tree_drafters import RandomQTreeDrafter

pytestmark = pytest.mark.statistical

V = 16
SLOTS = 32  # runs stepped together
PROMPT = [3, 7, 1, 12, 5, 9]


def exact_joint(engine: Engine, seq, sp: SamplingParams) -> torch.Tensor:
    """P(t1, t2) [V, V] from one verify of the tree root -> every token."""
    tree = DraftTree([seq.token_ids[-1]] + list(range(V)), [-1] + [0] * V)
    logits, _ = engine.verify(seq, tree)
    p = target_probs(logits, sp)  # row 0: p(t1); row 1 + t1: p(t2 | t1)
    return p[0][:, None] * p[1:]


def sample_pairs(engine: Engine, seqs: list, n: int) -> torch.Tensor:
    """Counts [V, V] of the first two generated tokens over n independent speculative runs, ``len(seqs)`` at a
    time: every sequence holds the same prefilled context in its own slot, and each run restarts one of them from
    it with a seed of its own; the sequences step together, as a served batch does (``Engine.run``)."""
    base = [(list(s.token_ids), s.cache_len) for s in seqs]
    counts = torch.zeros(V, V)
    for first in range(0, n, len(seqs)):
        live = seqs[:min(len(seqs), n - first)]
        out: dict[int, list[int]] = {}
        for j, s in enumerate(live):
            s.token_ids, s.cache_len, s.finish_reason = list(base[j][0]), base[j][1], None
            s.generator.manual_seed(10_000 + first + j)
            out[s.seq_id] = []
        todo = list(live)
        while todo:
            result = engine.run(StepPlan(decode=todo))
            assert not result.failed, result.failed
            for s in todo:
                out[s.seq_id] += result.emitted[s.seq_id]
            todo = [s for s in todo if len(out[s.seq_id]) < 2]
        for s in live:
            counts[out[s.seq_id][0], out[s.seq_id][1]] += 1
    return counts


@pytest.fixture(scope="module")
def engine(tiny_dir):
    # Thousands of tiny forwards: one thread avoids OpenMP spin/wake costs that dominate such small ops.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = config_from_dict({"model": {"source": str(tiny_dir), "dtype": "float32", "device": "cpu"},
                            "cache": {"num_slots": SLOTS, "max_seq_len": 64}})
    yield load_engine(cfg, RandomQTreeDrafter(V, max_rows=12, seed=0))
    torch.set_num_threads(threads)


def _prefilled(engine: Engine, sp: SamplingParams) -> list:
    seqs = []
    for _ in range(SLOTS):
        seq = engine.add(PROMPT, SamplingParams(), max_new_tokens=50)  # greedy prefill: a fixed first token
        engine.prefill(seq)
        seq.sampling = sp
        seqs.append(seq)
    return seqs


def speculative_pvalue(engine: Engine, sp: SamplingParams, n: int = 10_000) -> float:
    """Chi-square p-value of n speculative (t1, t2) draws against the exact joint, from one prefilled context."""
    seqs = _prefilled(engine, sp)
    try:
        joint = exact_joint(engine, seqs[0], sp)  # first: sampling moves a sequence on from the prefilled context
        return chi2_pvalue(sample_pairs(engine, seqs, n), joint)
    finally:
        for seq in seqs:
            engine.release(seq)


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0),
                                SamplingParams(temperature=0.7, top_k=10, top_p=0.9)],
                         ids=["t1", "t0.7-k10-p0.9"])
def test_speculative_sampling_matches_target(engine, sp):
    assert speculative_pvalue(engine, sp) > 1e-3


def test_negative_control_broken_rule_is_caught(engine, monkeypatch):
    """Sampling the bonus from the unmodified p after rejections (a classic bug) must be detected."""
    monkeypatch.setattr(acceptance, "residual", lambda left, p_node, rejected: p_node)
    assert speculative_pvalue(engine, SamplingParams(temperature=1.0)) < 1e-6
