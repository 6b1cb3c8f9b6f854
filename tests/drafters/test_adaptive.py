"""Adaptive draft length: the acceptance head, the stopping rule, the training examples (exactly what the drafter
computes at inference), `glide-adaptive` lossless and really adaptive, and a short real training run."""
from __future__ import annotations

import math

import pytest
import torch

from core.sampling import SamplingParams
from drafters.adaptive import (NUM_EXTRA, AcceptHead, AcceptHeadConfig, AcceptHeadError, AdaptiveStop,
                               default_checkpoint, load_accept_head)
from drafters.base import create_drafter
from drafters.glide.model import GlideConfig, GlideModel
from training.accept_head import auc, calibration, delayed_rows, weighted_bce
from server.engine import Engine
from tests.lossless import assert_lossless, drafts_per_step, plain_tokens


# -- the stopping rule and the head ------------------------------------------------------------------------------
def test_stop_once_the_chance_of_a_rejection_passes_the_threshold():
    stop = AdaptiveStop(0.3)
    assert stop.more(0.9)       # 1 - 0.9 = 0.1
    assert stop.more(0.9)       # 1 - 0.81 = 0.19
    assert not stop.more(0.5)   # 1 - 0.405 = 0.595 > 0.3
    stop = AdaptiveStop(0.5)
    assert [stop.more(0.8) for _ in range(4)] == [True, True, True, False]  # 0.8^3 = 0.512 >= 0.5 > 0.8^4
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="threshold"):
            AdaptiveStop(bad)


def test_head_blocks_have_their_own_weights_and_it_round_trips(tmp_path):
    c = AcceptHeadConfig("tiny", "glide", 16, num_blocks=3)
    head = AcceptHead(c)
    ptrs = {b.weight.data_ptr() for b in head.blocks}
    assert len(ptrs) == 3  # the authors' code reused one block D times
    with torch.no_grad():
        for b in head.blocks:
            b.weight.normal_()
    h, extra = torch.randn(5, 16), torch.randn(5, NUM_EXTRA)
    path = tmp_path / "accept-glide.safetensors"
    head.save(path, {"note": "test"})
    again = AcceptHead.load(path)
    assert torch.allclose(again(h, extra), head(h, extra)) and again.c == c
    assert not torch.allclose(head(h, extra), head(h, extra + 1))  # the extra inputs are read
    only = AcceptHead(AcceptHeadConfig("tiny", "glide", 16, hidden_only=True))
    assert torch.equal(only(h, extra), only(h, extra + 1))


def test_missing_or_mismatched_head_fails_clearly(target32, tmp_path):
    with pytest.raises(AcceptHeadError, match="specserve train accept-head --drafter glide"):
        load_accept_head(target32, "glide", 576, tmp_path / "nope.safetensors")
    AcceptHead(AcceptHeadConfig("other-model", "glide", 576)).save(tmp_path / "other.safetensors")
    with pytest.raises(AcceptHeadError, match="target 'other-model'"):
        load_accept_head(target32, "glide", 576, tmp_path / "other.safetensors")


def test_weighted_bce_weighs_rejections():
    logits, label = torch.tensor([0.3, -0.2]), torch.tensor([1.0, 0.0])
    one, three = weighted_bce(logits, label, 1.0), weighted_bce(logits, label, 3.0)
    assert torch.isclose(one, torch.nn.functional.binary_cross_entropy_with_logits(logits, label))
    assert torch.isclose(three - one, -2 * torch.nn.functional.logsigmoid(torch.tensor(0.2)) / 2)


def test_auc_and_calibration_match_brute_force():
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 6, (200,), generator=g).float()  # ties on purpose
    y = (torch.rand(200, generator=g) < 0.2 + 0.1 * s).float()
    pos, neg = s[y > 0.5], s[y <= 0.5]
    want = ((pos[:, None] > neg[None, :]).float() + 0.5 * (pos[:, None] == neg[None, :]).float()).mean()
    assert math.isclose(auc(s, y), float(want), rel_tol=1e-5)
    cal = calibration(torch.tensor([0.05, 0.07, 0.95]), torch.tensor([0.0, 1.0, 1.0]))
    assert cal == [{"bin": "0.0-0.1", "n": 2, "predicted": 0.06, "observed": 0.5},
                   {"bin": "0.9-1.0", "n": 1, "predicted": 0.95, "observed": 1.0}]


# -- training examples are the drafter's inference computation ----------------------------------------------------
def _tiny_glide():
    from core.ops import LlamaArgs

    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                     head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True,
                     max_position_embeddings=128, bos_token_id=0, eos_token_ids=(1,))
    m = GlideModel(GlideConfig.for_target(args, "tiny", hidden_size=32, num_heads=4, num_kv_heads=2,
                                          intermediate_size=64))
    for p in m.parameters():
        p.data.normal_(0, 0.3)
    emb = torch.randn(50, 32)
    return m.attach(emb, emb).eval()


@torch.inference_mode()
def test_delayed_rows_equal_incremental_drafting():
    """The state a token at position p is drafted from at depth d is what the drafter computes at inference: catch-up
    of the verified text before the root s = p - d, then the root and the d - 1 accepted tokens one forward each
    (target K/V of the s verified tokens)."""
    model = _tiny_glide()
    T, Hkv, D = 12, 2, 8
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 50, (T,), generator=g)
    kv = (torch.randn(Hkv, T, D, generator=g), torch.randn(Hkv, T, D, generator=g))
    for d in (1, 2, 4):
        rows = delayed_rows(model, ids, [kv], d - 1)
        for p in range(d, T):
            s = p - d
            ck = torch.zeros(1, 2, 32, D)
            cache = (ck, torch.zeros_like(ck))
            tkv = [(kv[0][:, :s], kv[1][:, :s])]
            if s:
                model(ids[:s], torch.arange(s), cache, 0, None, None, kv_only=True)
            for q in range(s, p):  # the root, then the accepted tokens (the verified text)
                h = model(ids[q:q + 1], torch.tensor([q]), cache, q, tkv, None)
            assert torch.allclose(rows[p - 1], h[0], atol=1e-5), (d, p)


# -- glide-adaptive on the real model (prompt_ids: tests/drafters/conftest.py) -----------------------------------
@pytest.mark.parametrize("drafter", ["glide", "falcon"])
def test_shipped_heads_exist(drafter):
    assert default_checkpoint("SmolLM2-135M-Instruct", drafter).is_file(), "the trained head must ship"


@pytest.mark.slow
@pytest.mark.parametrize("name,cap", [("glide-adaptive", {"max_gamma": 8}), ("falcon-adaptive", {"max_forwards": 2})])
def test_adaptive_drafters_are_lossless_and_their_length_follows_the_threshold(fp32_config, target32, stops,
                                                                                prompt_ids, name, cap):
    plain = plain_tokens(Engine(fp32_config, create_drafter("none", target32), target32), prompt_ids, 40, stops)
    lengths = {}
    for h in (0.05, 0.5, 0.95):
        spec = Engine(fp32_config, create_drafter(name, target32, {"threshold": h, **cap}), target32)
        lengths[h] = drafts_per_step(assert_lossless(spec, prompt_ids, plain, 40, stops, label=(name, h)))
    # a low threshold stops early, a high one drafts on; in between the length varies from step to step
    assert 1.0 <= lengths[0.05] < lengths[0.5] < lengths[0.95] <= 8.0, lengths
    assert lengths[0.05] < 1.5 and lengths[0.95] > 1.5, lengths  # a chain of 1 or more tokens per step


def test_glide_adaptive_sampled_tree_is_valid(fp32_config, target32, prompt_ids):
    drafter = create_drafter("glide-adaptive", target32, {"threshold": 0.9})
    engine = Engine(fp32_config, drafter, target32)
    seq = engine.add(prompt_ids[0], SamplingParams(temperature=0.8), max_new_tokens=24)
    engine.prefill(seq)
    tree = drafter.propose(engine.view(seq))
    tree.validate(target32.args.vocab_size)
    assert tree.q is not None and torch.allclose(tree.q[1:].sum(-1), torch.ones(tree.num_draft), atol=1e-5)
    while seq.finish_reason is None:
        engine.step(seq)
    engine.release(seq)
    assert seq.num_generated == 24


def test_falcon_adaptive_caps_its_forwards(target32):
    with pytest.raises(ValueError, match="max_forwards"):
        create_drafter("falcon-adaptive", target32, {"max_forwards": 3})


@pytest.mark.parametrize("drafter", ["glide", "falcon"])
def test_a_short_training_run_writes_a_head_that_loads(fp32_config, target32, tmp_path, drafter):
    from training.accept_head import AcceptTrainOptions, run_train_accept_head
    from training.hf_reference import generate_responses
    from training.prompts import training_records

    recs = training_records(humaneval=False)[::300][:3]
    data = tmp_path / "answers.pt"
    generate_responses(target32.hf_dir, target32.model_id, recs, data, max_new_tokens=20, batch_size=3,
                       dtype=torch.float32, progress=False, gguf=target32.gguf)
    out = run_train_accept_head(fp32_config, drafter, tmp_path / f"accept-{drafter}.safetensors", data_path=data,
                                opts=AcceptTrainOptions(max_depth=3, keep=1.0, steps=20, batch=64, val_fraction=0.34),
                                limit=3, work=tmp_path, progress=False, log=lambda m: None)
    import json

    card = json.loads(out.with_suffix(".json").read_text())
    assert card["data"]["examples"] > 0 and "greedy" in card["validation"]
    head = load_accept_head(target32, drafter, 576, out)
    adaptive = create_drafter(f"{drafter}-adaptive", target32, {"accept_head": str(out)})
    assert adaptive.head.c == head.c and head.c.drafter == drafter
    with pytest.raises(AcceptHeadError, match=f"drafter '{drafter}'"):  # a head for the other drafter is refused
        create_drafter("falcon-adaptive" if drafter == "glide" else "glide-adaptive", target32,
                       {"accept_head": str(out)})


def test_a_head_reads_only_the_drafter_checkpoint_it_was_trained_on(target32, tmp_path):
    import dataclasses

    from drafters.checkpoint import CHECKPOINT_DIR

    head = AcceptHead.load(default_checkpoint(target32.model_id, "glide"))
    assert head.c.drafter_checkpoint and head.c.drafter_digest  # the shipped head names its GLIDE checkpoint
    trained_on = GlideModel.load(CHECKPOINT_DIR / target32.model_id / head.c.drafter_checkpoint)
    drafter = create_drafter("glide-adaptive", target32)  # ... and glide-adaptive loads that one by default
    mine = drafter.model.state_dict()
    assert all(torch.equal(mine[k].cpu(), v.to(mine[k].dtype)) for k, v in trained_on.state_dict().items()
               if v is not None and k in mine)
    other = dataclasses.replace(head.c, drafter_digest="0" * 16)
    AcceptHead(other).save(tmp_path / "other.safetensors")
    with pytest.raises(AcceptHeadError, match="specserve train accept-head --drafter glide"):
        create_drafter("glide-adaptive", target32, {"accept_head": str(tmp_path / "other.safetensors")})
