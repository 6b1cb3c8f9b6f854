"""Falcon's drafter tree: the Cartesian product of one forward, expansion under the most probable leaves, the row cap
and a head with taps, against a cache-free reference; and checkpoint and option errors.

Random-weight checkpoints (tmp dirs) stand in for the trained one, on the tiny random Llama of tests/conftest.py
(fixtures: tests/drafters/conftest.py; the reference: tests/drafters/falcon_tiny.py). Sampled requests, the cache and
losslessness are tests/drafters/test_falcon_decoding.py's."""
from __future__ import annotations

import pytest
import torch

from drafters.base import create_drafter
from drafters.falcon.drafter import FalconDrafter
from drafters.falcon.model import FalconCheckpointError, FalconConfig, FalconModel, default_checkpoint
from server.engine import Engine
from tests.drafters.falcon_tiny import (OPTS, TINY_PROMPTS, V, _reference_model, _start, _tiny_config, reference_block,
                                        reference_tree)
from tests.lossless import assert_lossless

pytestmark = pytest.mark.usefixtures("_one_thread")  # tests/drafters/conftest.py


# -- the tree on the tiny target ----------------------------------------------------------------------------------
def test_greedy_tree_is_the_cartesian_product_of_one_forward(tiny_dir, tiny, tiny_ckpt):
    drafter = FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=1)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    ref = _reference_model(tiny, tiny_ckpt[2])
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt)
        view = engine.view(seq)
        tree = drafter.propose(view)
        tree.validate(V)
        assert tree.q is None  # greedy: top-k point masses
        assert tree.parents == [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]  # root, 3 children, 2 under each: 9 draft rows
        first, second = tree.tokens[1:4], tree.tokens[4:]
        assert len(set(first)) == 3 and second == second[:2] * 3  # one forward: the same 2nd tokens under each node
        probs = torch.softmax(ref.logits(reference_block(ref, view, [])).float(), -1)
        vocab = ref.vocab_ids
        assert first == vocab[torch.topk(probs[0], 3).indices].tolist()
        assert second[:2] == vocab[torch.topk(probs[1], 2).indices].tolist()
        engine.release(seq)


@pytest.mark.parametrize("k,top_m,forwards,width,max_rows,next_top_m", [
    (2, (3, 2), 2, 1, 24, None),   # one extra block, under the most probable leaf
    (2, (3, 2), 2, 2, 32, None),   # two blocks in one forward, neither sees the other
    (2, (3, 2), 3, 1, 40, None),   # a third block: under the best leaf left, a drafted block among its ancestors
    (2, (2, 2), 4, 2, 64, None),   # deep: blocks three levels below the root
    (2, (3, 2), 3, 2, 20, None),   # the cap cuts a block's Cartesian product
    (3, (2, 2, 1), 3, 2, 40, None),  # k = 3
    (2, (2, 1), 3, 1, 40, (1, 1)),   # branches in the first block only, chains under it
    (2, (1, 1), 2, 2, 40, (2, 2)),   # a chain first, then a wider block
])
def test_expanded_tree_matches_the_cache_free_reference(tiny_dir, tiny, tiny_ckpt, k, top_m, forwards, width,
                                                        max_rows, next_top_m):
    drafter = FalconDrafter(tiny, tiny_ckpt[k], top_m=top_m, forwards=forwards, width=width, max_rows=max_rows,
                            next_top_m=next_top_m)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    ref = _reference_model(tiny, tiny_ckpt[k])
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt)
        view = engine.view(seq)
        tree = drafter.propose(view)
        tree.validate(V)
        assert (tree.tokens, tree.parents) == reference_tree(ref, view, top_m, forwards, width, max_rows, next_top_m)
        assert tree.num_rows <= max_rows
        engine.release(seq)


def test_a_head_with_taps_reads_the_targets_lower_layers(tiny_dir, tiny, tiny_ckpt):
    """A head that reads a lower target layer (EAGLE-3's multi-layer features): the engine keeps the layer's residual
    stream beside the hidden states (the target's own forward computes the same), the drafter's expanded tree is the
    cache-free reference's with those rows, the tap weights change it, and greedy decoding stays lossless."""
    drafter = FalconDrafter(tiny, tiny_ckpt["taps"], **OPTS, weights="dense")  # the reference zeroes a matrix
    assert drafter.target_taps == (1,)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    W = tiny.args.hidden_size
    assert engine.pool.hidden.shape[-1] == 2 * W
    ref = _reference_model(tiny, tiny_ckpt["taps"], "dense")
    blind = _reference_model(tiny, tiny_ckpt["taps"], "dense")
    with torch.no_grad():
        blind.tap_fuse.zero_()
    differs = 0
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt)
        view = engine.view(seq)
        own = tiny.forward(view.tokens[:-1], (1,))
        assert torch.allclose(view.target_taps(), own.taps, atol=1e-5)
        assert torch.allclose(view.target_hidden(), own.hidden, atol=1e-5)
        tree = drafter.propose(view)
        want = reference_tree(ref, view, OPTS["top_m"], OPTS["forwards"], OPTS["width"], OPTS["max_rows"])
        assert (tree.tokens, tree.parents) == want
        differs += want != reference_tree(blind, view, OPTS["top_m"], OPTS["forwards"], OPTS["width"],
                                          OPTS["max_rows"])
        engine.release(seq)
    assert differs
    plain = Engine(_tiny_config(tiny_dir), create_drafter("none", tiny), tiny)
    assert_lossless(engine, TINY_PROMPTS, plain, 40)


def test_expansion_hangs_under_the_most_probable_leaf(tiny_dir, tiny, tiny_ckpt):
    """forwards=2, width=1: the first forward's tree, then a whole Cartesian block under its most probable leaf."""
    engine = Engine(_tiny_config(tiny_dir), FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=1), tiny)
    deep = FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=2, width=1, max_rows=24)
    ref = _reference_model(tiny, tiny_ckpt[2])
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt)
        view = engine.view(seq)
        one, two = engine.drafter.propose(view), deep.propose(view)
        assert two.tokens[:10] == one.tokens and two.parents[:10] == one.parents
        probs = torch.softmax(ref.logits(reference_block(ref, view, [])).float(), -1)
        local = {int(t): i for i, t in enumerate(ref.vocab_ids)}
        score = {r: float(probs[0, local[one.tokens[one.parents[r]]]] * probs[1, local[one.tokens[r]]])
                 for r in range(4, 10)}
        best = max(score, key=score.get)
        assert two.num_rows == 19 and two.parents[10:] == [best] * 3 + [10, 10, 11, 11, 12, 12]
        engine.release(seq)


def test_max_rows_truncates_the_same_tree_and_stops_forwards(tiny_dir, tiny, tiny_ckpt):
    engine = Engine(_tiny_config(tiny_dir), FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=3, width=2,
                                                          max_rows=64), tiny)
    seq = _start(engine, TINY_PROMPTS[0])
    view = engine.view(seq)
    full = engine.drafter.propose(view)
    assert full.num_rows == 1 + 9 + 2 * 9 + 2 * 9
    for cap in (2, 5, 7, 10, 16, 25, 37):
        d = FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=3, width=2, max_rows=cap)
        tree = d.propose(view)
        assert tree.num_rows == cap
        assert (tree.tokens, tree.parents) == (full.tokens[:cap], full.parents[:cap])
        if cap <= 10:  # the first forward fills the tree: no expansion forward runs (the other one caught up)
            assert d.num_forwards == 2, cap
    engine.release(seq)


# -- checkpoints and options --------------------------------------------------------------------------------------
def test_missing_or_mismatched_checkpoint_fails_clearly(tiny, tiny_ckpt, tmp_path):
    assert not default_checkpoint(tiny.model_id).exists()
    with pytest.raises(FalconCheckpointError, match="specserve train falcon"):
        create_drafter("falcon", tiny)  # no checkpoint for this target at the default path
    with pytest.raises(FalconCheckpointError, match="nope.safetensors.*specserve train falcon"):
        FalconDrafter(tiny, checkpoint=str(tmp_path / "nope.safetensors"))
    m = FalconModel.load(tiny_ckpt[2])
    m.c.target_id = "some-other-model"
    m.save(tmp_path / "other.safetensors")
    with pytest.raises(FalconCheckpointError, match="trained for target 'some-other-model'.*specserve train falcon"):
        FalconDrafter(tiny, checkpoint=str(tmp_path / "other.safetensors"))
    shapes = FalconModel(FalconConfig.for_target(tiny.args, tiny.model_id, num_kv_heads=4, vocab_subset=12))
    shapes.save(tmp_path / "shapes.safetensors")
    with pytest.raises(FalconCheckpointError, match="target shapes.*specserve train falcon"):
        FalconDrafter(tiny, checkpoint=str(tmp_path / "shapes.safetensors"))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(FalconCheckpointError, match="not a Falcon checkpoint"):
        FalconDrafter(tiny, checkpoint=str(tmp_path / "plain.safetensors"))


def test_bad_options_fail_with_the_option(tiny, tiny_ckpt):
    for bad in ({"top_m": [3]}, {"top_m": [3, 0]}, {"next_top_m": [1]}, {"next_top_m": [0, 1]}, {"forwards": 0},
                {"width": 9}, {"max_rows": 65}, {"max_rows": 1}):
        with pytest.raises(ValueError, match="falcon"):
            create_drafter("falcon", tiny, {"checkpoint": tiny_ckpt[2], **bad})
    with pytest.raises(ValueError, match="top_m needs 3"):
        create_drafter("falcon", tiny, {"checkpoint": tiny_ckpt[3], "top_m": [3, 2]})
