"""Engine admission, slots, limits and bad input."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from core.tree import DraftTree
from server.config import config_from_dict
from server.engine import Engine, NoFreeSlotError, RequestError, load_engine


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir):
    cfg = config_from_dict({"model": {"source": str(tiny_dir), "dtype": "float32", "device": "cpu"},
                            "cache": {"num_slots": 2, "max_seq_len": 32}})
    return load_engine(cfg)


def test_bad_prompts_raise_clear_errors(tiny_engine):
    with pytest.raises(RequestError, match="empty"):
        tiny_engine.add([])
    with pytest.raises(RequestError, match="context"):
        tiny_engine.add(list(range(2, 14)) * 3)  # 36 tokens > 32
    with pytest.raises(RequestError, match="token ids"):
        tiny_engine.add([1, 99])
    with pytest.raises(RequestError, match="max_new_tokens"):
        tiny_engine.add([2, 3], max_new_tokens=0)
    assert tiny_engine.pool.slots_used == 0  # failed admissions take no slot


def test_no_free_slot_then_release(tiny_engine):
    a, b = tiny_engine.add([2, 3]), tiny_engine.add([4, 5])
    with pytest.raises(NoFreeSlotError):
        tiny_engine.add([6])
    assert tiny_engine.pool.slots_used == 2
    tiny_engine.release(a)
    c = tiny_engine.add([6])
    assert c.slot == a.slot
    for s in (b, c):
        tiny_engine.release(s)
    assert tiny_engine.pool.slots_used == 0 and tiny_engine.kv_usage() == (0.0, 0.0)


def test_limits_and_stop_tokens(tiny_engine):
    out = tiny_engine.generate([2, 3, 4], max_new_tokens=5)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.stats.verify_steps == 4 and out.stats.mean_accepted_length == 1.0
    stop = out.token_ids[-1]
    cut = out.token_ids.index(stop) + 1  # generation ends at the first occurrence, stop token included
    stopped = tiny_engine.generate([2, 3, 4], max_new_tokens=5, stop_token_ids=[stop])
    assert stopped.finish_reason == "stop" and stopped.token_ids == out.token_ids[:cut]
    # the context ends the sequence: 30 prompt tokens + 2 generated fill the 32-token slot
    full = tiny_engine.generate([2] * 30, max_new_tokens=100)
    assert full.finish_reason == "length" and len(full.token_ids) == 2


def test_kv_usage_reported(tiny_engine):
    tiny_engine = Engine(tiny_engine.cfg, target=tiny_engine.target)  # an empty prefix cache
    seq = tiny_engine.add([2, 3, 4, 5])
    tiny_engine.prefill(seq)
    assert tiny_engine.kv_usage() == pytest.approx((4 / (2 * 32), 0.0))
    tiny_engine.step(seq)
    assert tiny_engine.kv_usage() == pytest.approx((5 / (2 * 32), 0.0))
    tiny_engine.release(seq)  # its committed rows stay in the prefix cache, apart from running ones
    assert tiny_engine.kv_usage() == pytest.approx((0.0, 5 / (2 * 32)))
    tiny_engine.release(tiny_engine.add([9, 9, 9]), cache=False)  # takes the idle slot or the free one


def test_seeded_sampling_is_reproducible(tiny_engine):
    sp = SamplingParams(temperature=1.0, seed=1234)
    a = tiny_engine.generate([2, 3, 4], sp, max_new_tokens=12).token_ids
    b = tiny_engine.generate([2, 3, 4], sp, max_new_tokens=12).token_ids
    c = tiny_engine.generate([2, 3, 4], SamplingParams(temperature=1.0, seed=99), max_new_tokens=12).token_ids
    assert a == b and a != c


class _BadDrafter:
    name = "bad"

    def __init__(self, tree_fn):
        self.tree_fn = tree_fn

    def prefill(self, seq): pass
    def propose(self, seq): return self.tree_fn(seq)
    def observe(self, seq, result): pass
    def release(self, seq_id): pass


@pytest.mark.parametrize("tree_fn,match", [
    (lambda s: DraftTree([s.tokens[-1], 3], [-1, 1]), "topological"),
    (lambda s: DraftTree([s.tokens[-1], 300], [-1, 0]), "out of range"),
    (lambda s: DraftTree.chain(s.tokens[-1], [2] * 70), "at most 64"),
    (lambda s: DraftTree.chain((s.tokens[-1] + 1) % 16, [2]), "rooted"),
])
def test_malformed_trees_are_rejected(tiny_engine, tree_fn, match):
    engine = Engine(tiny_engine.cfg, _BadDrafter(tree_fn), tiny_engine.target)
    seq = engine.add([2, 3, 4])
    engine.prefill(seq)
    with pytest.raises((ValueError, RuntimeError), match=match):
        engine.step(seq)
    engine.release(seq)


def test_target_view_exposes_verified_kv_and_hidden(tiny_engine):
    seen = {}

    class Peek(_BadDrafter):
        def observe(self, seq, result):
            k, v = seq.target_kv(1)
            seen.update(k=k.clone(), hidden=seq.target_hidden().clone(), cache_len=seq.cache_len,
                        tokens=list(seq.tokens))

    engine = Engine(tiny_engine.cfg, Peek(lambda s: DraftTree.root_only(s.tokens[-1])), tiny_engine.target)
    seq = engine.add([2, 3, 4, 5])
    engine.prefill(seq)
    engine.step(seq)
    engine.release(seq)
    assert seen["cache_len"] == 5 == len(seen["tokens"]) - 1
    a = engine.model.args
    assert seen["k"].shape == (a.num_kv_heads, 5, a.head_dim)
    assert seen["hidden"].shape == (5, a.hidden_size)
    # the cached K of the first 5 tokens equals a fresh causal forward's K (post-RoPE)
    seq2 = engine.add(seen["tokens"][:5], namespace="elsewhere")  # no prefix hit: every row computed here
    engine.forward(seq2, seen["tokens"][:5], torch.arange(5))
    torch.testing.assert_close(engine.pool.k[1, seq2.slot, :, :5], seen["k"])
    engine.release(seq2)


def test_the_row_budget_stops_at_the_tokens_still_wanted(tiny_engine):
    """A step emits at most its rows, so a tree never has more rows than the request still wants tokens, and the
    drafter is told (``max_rows``) before it drafts; with one token left the step is a plain decode step."""
    seen = []  # (tokens still wanted, the budget the drafter saw)

    def tree_fn(view):
        seen.append((5 - (len(view.tokens) - view.prompt_len), view.max_rows))
        return DraftTree.chain(view.tokens[-1], [2] * 8)

    engine = Engine(tiny_engine.cfg, _BadDrafter(tree_fn), tiny_engine.target)
    out = engine.generate([2, 3, 4], max_new_tokens=5)
    assert len(out.token_ids) == 5
    assert seen and all(budget == min(wanted, 64) for wanted, budget in seen), seen
    assert out.stats.draft_tokens == sum(wanted - 1 for wanted, _ in seen)  # what was verified: within the budget


@pytest.mark.parametrize("seed", [None, 5])
def test_sampled_acceptance_builds_only_the_rows_its_walk_reads(tiny_engine, monkeypatch, seed):
    """A sampled request's target distribution (temperature, top-p: a sort over the vocabulary per row) is built
    for the tree rows acceptance reads, one row at a time as plain decoding builds its one row, not for every row."""
    import server.engine.acceptance as acceptance

    built, real = [], acceptance.target_probs
    monkeypatch.setattr(acceptance, "target_probs", lambda x, sp: built.append(x.shape[0]) or real(x, sp))
    for trial in range(4):
        sp = SamplingParams(temperature=0.8, top_p=0.9, seed=None if seed is None else seed + trial)
        seq = tiny_engine.add([3, 7, 1, 12, 5], sp, max_new_tokens=8)
        tiny_engine.prefill(seq)
        tree = DraftTree([seq.token_ids[-1], 2, 9, 4, 4, 13, 6], [-1, 0, 1, 2, 0, 4, 5])  # point masses
        built.clear()
        with torch.inference_mode():
            logits, _ = tiny_engine.verify(seq, tree)
            path, tokens, _ = tiny_engine._accept(seq, tree, logits)
        assert built == [1] * len(path), (built, path)  # the path's rows, each once
        tiny_engine.release(seq)
