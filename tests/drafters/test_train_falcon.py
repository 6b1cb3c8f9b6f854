"""Falcon training (CSGD): the two streams' mask shows a guessed block verified context only, glancing swaps runs from
block starts, and a few real training steps on the default model's features lower the loss and reload."""
from __future__ import annotations

import random

import torch

from drafters.falcon.model import FalconModel, relaxed_mask
from training.falcon import PROBE_STEPS, build_model, hash_split, packs, steps_for_seconds, train, with_taps
from training.falcon_features import FeatureData, teacher_features
from training.falcon_loss import (FalconTrainOptions, all_right_in_block, glance_rows, loss_tables, pack_loss,
                                  row_counts, sequence_loss, two_stream_mask)
from training.glide import TrainOptions, split_rows


def test_two_stream_mask_shows_a_guessed_block_verified_context_only():
    true_b = torch.tensor([0, 0, 1, 1, 2, 2])
    pred_b = torch.tensor([1, 1, 2, 2])
    m = two_stream_mask(true_b, pred_b).int()
    assert torch.equal(m[:6, :6], relaxed_mask(true_b).int()) and not m[:6, 6:].any()
    assert m[6:, :6].tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert m[6:, 6:].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]


def test_glancing_replaces_runs_from_block_starts():
    blocks = torch.tensor([1, 1, 2, 2, 3, 3, 4, 4])
    for n in range(0, 9):
        g = glance_rows(blocks, n, random.Random(n))
        assert int(g.sum()) == n
        for b in blocks.unique():
            assert g[blocks == b].tolist() in ([False, False], [True, False], [True, True])  # a run from the start
    assert not glance_rows(blocks, 0, random.Random(0)).any()


def _features(target32):
    tok = [[1, 2, 3] + list(range(100 + i, 140 + i)) for i in range(6)]
    items = [{"prompt_ids": t[:3], "response_ids": t[3:]} for t in tok]
    return teacher_features(target32, items, max_len=64, progress=False)


def test_glancing_swaps_lambda_times_the_hamming_distance(target32):
    """N = round(lambda * d) guessed inputs go back to the true ones: none at lambda 0, and the loss changes with it."""
    from training.falcon_loss import loss_tables

    data = _features(target32)
    torch.manual_seed(0)
    model = build_model(target32, torch.arange(512))
    tables = loss_tables(model)
    opts = FalconTrainOptions(noise=0.0, autocast=False)
    with torch.no_grad():
        loss0, rows0, st0 = sequence_loss(model, data, 0, opts, tables, lam=0.0)
        loss1, rows1, st1 = sequence_loss(model, data, 0, opts, tables, lam=0.5)
    assert st0["hamming"] > 0 and st0["glanced"] == 0 and rows0 == rows1
    assert st1["glanced"] == round(0.5 * st1["hamming"]) > 0 and float(loss1) != float(loss0)


def test_the_regression_weight_scales_the_feature_loss_alone(target32):
    """L = w_reg * SmoothL1 + w_dist * distillation: the two parts add up, and w_reg = 0 leaves the tokens' loss."""
    data = _features(target32)
    torch.manual_seed(0)
    model = build_model(target32, torch.arange(512))
    tables = loss_tables(model)

    def loss(w_reg, w_dist):
        opts = FalconTrainOptions(noise=0.0, autocast=False, w_reg=w_reg, w_dist=w_dist)
        with torch.no_grad():
            return float(sequence_loss(model, data, 0, opts, tables, train=False)[0])

    reg, dist = loss(1.0, 0.0), loss(0.0, 1.0)
    assert reg > 0 and dist > 0
    assert abs(loss(1.0, 1.0) - (reg + dist)) < 1e-3 * (reg + dist)
    assert abs(loss(0.5, 2.0) - (0.5 * reg + 2.0 * dist)) < 1e-3 * (reg + dist)


def test_a_few_training_steps_reduce_the_loss_and_checkpoints_reload(target32, tmp_path):
    data = _features(target32)
    assert isinstance(data, FeatureData) and len(data) == 6 and data.feats[0].shape == (43, target32.args.hidden_size)
    torch.manual_seed(0)
    model = build_model(target32, torch.arange(512))
    opts = FalconTrainOptions(steps=12, batch_tokens=128, warmup=2, save_every=12, val_fraction=0.2, autocast=False)
    summary = train(model, data, opts, tmp_path / "state.pt", progress=False, log=lambda *a: None)
    assert summary["history"][-1]["loss"] < summary["history"][0]["loss"]
    assert (tmp_path / "state.pt").exists()
    model.save(tmp_path / "falcon.safetensors", {"note": "test"})
    again = FalconModel.load(tmp_path / "falcon.safetensors")
    assert torch.equal(again.vocab_ids, model.vocab_ids) and again.c == model.c


def test_a_head_gains_lower_layers_starting_as_itself_and_learns_to_read_them(target32):
    """EAGLE-3's multi-layer features: the teacher pass keeps the residual stream after the tapped layers (the
    target's own), a head that gains taps computes what it computed (zero tap weights) on both streams, whatever order
    the file holds them in, and training moves the tap weights."""
    tok = [[1, 2, 3] + list(range(100 + i, 140 + i)) for i in range(6)]
    items = [{"prompt_ids": t[:3], "response_ids": t[3:]} for t in tok]
    data = teacher_features(target32, items, max_len=64, progress=False, taps=(15, 3))
    assert data.tap_layers == [15, 3] and data.taps[0].shape == (43, 2, target32.args.hidden_size)
    own = target32.forward(tok[0], (15, 3)).taps
    assert torch.equal(data.taps[0], own.to(torch.bfloat16))
    torch.manual_seed(0)
    model = build_model(target32, torch.arange(512))
    tapped = with_taps(model, [3, 15], target32)
    assert tapped.c.taps == [3, 15] and not tapped.tap_fuse.any()
    tables = loss_tables(model)
    opts = FalconTrainOptions(noise=0.0, autocast=False)
    with torch.no_grad():
        for i in range(2):
            want = sequence_loss(model, data, i, opts, tables, lam=0.5, rng=random.Random(i))
            got = sequence_loss(tapped, data, i, opts, tables, lam=0.5, rng=random.Random(i))
            assert torch.allclose(got[0], want[0], rtol=1e-5) and got[2] == want[2]
    opts = FalconTrainOptions(steps=3, batch_tokens=128, warmup=1, save_every=3, val_fraction=0.2, autocast=False)
    train(tapped, data, opts, None, progress=False, log=lambda *a: None)
    assert tapped.tap_fuse.abs().sum() > 0
    again = with_taps(tapped, [15, 3], target32)  # the taps it read keep their weights, in the new order
    W = target32.args.hidden_size
    assert torch.equal(again.tap_fuse[:, :W], tapped.tap_fuse[:, W:])
    assert torch.equal(again.tap_norm[W:], tapped.tap_norm[:W])


def test_falcon_holds_out_the_prompts_glide_holds_out_and_reports_them_by_source(target32):
    """The validation split is GLIDE's (by prompt hash), read through the teacher pass's item index, which skips
    sequences too short to train on; its groups are the prompt sources."""
    items = []
    for i in range(40):
        answer = list(range(200 + i, 210 + i)) if i % 7 else [5]  # every 7th answer is too short: skipped
        items.append({"prompt_ids": [1, 2, 3 + i], "response_ids": answer,
                      "source": "text:doc" if i % 5 == 0 else ("chat" if i % 2 else "synth")})
    data = teacher_features(target32, items, max_len=32, progress=False)
    assert len(data) == 34 and data.index == [i for i in range(40) if i % 7]
    opts = FalconTrainOptions(val_fraction=0.3)
    (train_idx, val_idx), groups = hash_split(data, items, opts)
    glide_train, glide_val = split_rows(items, data.index, TrainOptions(val_fraction=0.3, seed=opts.seed))
    assert val_idx == glide_val and train_idx == glide_train and 0 < len(val_idx) < len(data)
    assert sorted(i for rows in groups.values() for i in rows) == val_idx
    for name, rows in groups.items():
        sources = {items[data.index[i]]["source"] for i in rows}
        assert sources == ({"text:doc"} if name == "text" else {name})


def test_training_continues_from_a_checkpoint(fp32_config, random_answers, tmp_path):
    """``init``: the run starts from the checkpoint's weights, k and kept vocabulary (0 steps give it back as it was),
    then trains on; the card names the checkpoint it started from."""
    from safetensors.torch import load_file

    from drafters.adaptive import checkpoint_digest
    from training.falcon import run_train_falcon

    quiet = dict(data_path=random_answers, progress=False, log=lambda *a: None)
    opts = dict(batch_tokens=48, warmup=1, val_fraction=0.3, autocast=False, max_len=32)
    first = run_train_falcon(fp32_config, tmp_path / "a.safetensors", opts=FalconTrainOptions(steps=2, **opts),
                             k=2, vocab_subset=300, **quiet)
    same = run_train_falcon(fp32_config, tmp_path / "b.safetensors", opts=FalconTrainOptions(steps=0, **opts),
                            k=3, vocab_subset=100, init=first, **quiet)
    a, b = load_file(first), load_file(same)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)  # k and the vocabulary are the file's
    more = run_train_falcon(fp32_config, tmp_path / "c.safetensors", opts=FalconTrainOptions(steps=2, **opts),
                            init=first, **quiet)
    c = load_file(more)
    assert torch.equal(c["vocab_ids"], a["vocab_ids"]) and not torch.equal(c["fuse"], a["fuse"])
    card = __import__("json").loads(more.with_suffix(".json").read_text())
    assert card["training"]["init"] == {"file": "a.safetensors", "digest": checkpoint_digest(first)}
    assert card["history"][0]["step"] == 0
    tapped = run_train_falcon(fp32_config, tmp_path / "d.safetensors", opts=FalconTrainOptions(steps=0, **opts),
                              init=first, taps=[2], **quiet)  # --taps: the checkpoint gains a lower layer
    d = load_file(tapped)
    assert all(torch.equal(d[n], a[n]) for n in a) and not d["tap_fuse"].any()
    card = __import__("json").loads(tapped.with_suffix(".json").read_text())
    assert card["architecture"]["taps"] == [2] and card["history"][0]["agreement"] == card["validation"]["agreement"]


def test_packed_teacher_passes_give_each_sequences_own_forward(target32):
    """Sequences packed into one forward (each its own segment, positions from 0) give what one forward each gives:
    hidden states, K/V and lower layers, and the packed teacher pass keeps the same sequences in the same order."""
    from training.teacher import teacher_pass

    g = torch.Generator().manual_seed(0)
    lens = [(5, 9), (3, 1), (12, 4), (2, 17), (7, 6)]  # (prompt, answer) tokens; (3, 1) is too short to keep
    items = [{"prompt_ids": torch.randint(10, 2000, (p,), generator=g).tolist(),
              "response_ids": torch.randint(10, 2000, (r,), generator=g).tolist()} for p, r in lens]
    seqs = [it["prompt_ids"] + it["response_ids"] for it in items]
    packed = target32.forward_many(seqs, (3, 15))
    for ids, tp in zip(seqs, packed):
        one = target32.forward(ids, (3, 15))
        for a, b in ((tp.hidden, one.hidden), (tp.k, one.k), (tp.v, one.v), (tp.taps, one.taps)):
            # float32 round-off of GEMMs blocked by row count (AMX): relative to the tensor's scale, since the
            # residual stream holds values in the thousands beside values near zero
            assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    base = teacher_pass(target32, items, [2], 16, progress=False, all_positions=True, min_answer=3, taps=(3,),
                        batch_tokens=0)
    assert base.index == [0, 2, 3, 4]  # the second is too short; the fourth is cut to 16 tokens
    for batch in (20, 10 ** 6):  # some groups and one forward for all
        t = teacher_pass(target32, items, [2], 16, progress=False, all_positions=True, min_answer=3, taps=(3,),
                         batch_tokens=batch)
        assert t.index == base.index and t.answer_start == base.answer_start
        assert all(torch.equal(a, b) for a, b in zip(t.tokens, base.tokens))
        for field in ("hidden", "kv", "taps"):
            for a, b in zip(getattr(t, field), getattr(base, field)):
                assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2), field


def test_the_padded_pass_gives_the_engines_features_in_the_items_order(target32, hf_model32):
    """The GPU's teacher pass (padded batches of similar lengths through the Hugging Face model) keeps the sequences
    the engine's pass keeps, in the items' order, with the same final-normed features and lower layers."""
    from training.teacher import padded_pass, teacher_pass

    g = torch.Generator().manual_seed(1)
    lens = [(9, 30), (3, 1), (4, 6), (20, 50), (2, 2), (6, 12), (5, 40)]  # (3, 1) and (2, 2): under 3 answer rows
    items = [{"prompt_ids": torch.randint(10, 2000, (p,), generator=g).tolist(),
              "response_ids": torch.randint(10, 2000, (r,), generator=g).tolist()} for p, r in lens]
    base = teacher_pass(target32, items, [], 48, progress=False, all_positions=True, min_answer=3, taps=(3, 15),
                        batch_tokens=0)
    assert base.index == [0, 2, 3, 5, 6]
    for rows in (60, 10 ** 6):  # batches of one to three sequences (shortest first), and one batch for all
        t = padded_pass(target32, items, 48, min_answer=3, taps=(3, 15), rows=rows, model=hf_model32)
        assert t.index == base.index and t.answer_start == base.answer_start
        assert all(torch.equal(a, b) for a, b in zip(t.tokens, base.tokens))
        for field in ("hidden", "taps"):
            for a, b in zip(getattr(t, field), getattr(base, field)):
                assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2), field


def test_a_time_budget_sets_the_steps_from_the_measured_pace(target32):
    """``seconds``: the steps that fit once the probe's steps and the evaluations are paid for; a budget the probe
    alone exceeds stops right after it, with the last evaluation as usual."""
    assert steps_for_seconds(100.0, 10.0, 25, 0.125, 2.5, 20) == 25 + 360  # 90 s at 0.125 s + 2.5 s / 20 steps
    assert steps_for_seconds(100.0, 10.0, 25, 0.125, 0.0, 20) == 25 + 720
    assert steps_for_seconds(5.0, 10.0, 25, 0.125, 2.5, 20) == 25  # over budget already
    data = _features(target32)
    torch.manual_seed(0)
    model = build_model(target32, torch.arange(512))
    opts = FalconTrainOptions(steps=1000, batch_tokens=64, warmup=2, save_every=10, val_fraction=0.2,
                              autocast=False, seconds=1e-3)
    summary = train(model, data, opts, progress=False, log=lambda *a: None)
    assert opts.steps == summary["steps"] == PROBE_STEPS[1]
    assert [h["step"] for h in summary["history"]] == [0, 10, 20, 25]


def test_rows_count_as_right_only_when_their_whole_block_was_guessed_right():
    blocks = torch.tensor([1, 1, 2, 2, 3, 4, 4])
    wrong = torch.tensor([False, False, False, True, False, True, True])
    assert all_right_in_block(blocks, wrong).tolist() == [True, True, False, False, True, False, False]
    assert all_right_in_block(blocks[:0], wrong[:0]).tolist() == []


def test_training_time_test_feeds_the_second_block_the_true_tokens(target32):
    """With the training-time test the predicted stream reads the target's tokens: what the head guesses for them
    does not change the loss (and nothing is glanced); with CSGD the guesses are its inputs."""
    data = _features(target32)
    torch.manual_seed(0)
    model = build_model(target32, torch.arange(512))
    tables = loss_tables(model)
    wrong_guesses = dict(tables, vocab_ids=tables["vocab_ids"].roll(1))  # every guess a different token

    def loss(opts, t):
        with torch.no_grad():
            out, rows, st = sequence_loss(model, data, 0, opts, t, lam=0.4)
        return float(out), st

    ttt = FalconTrainOptions(noise=0.0, autocast=False, ttt=True)
    (a, st_a), (b, st_b) = loss(ttt, tables), loss(ttt, wrong_guesses)
    assert a == b and st_a["glanced"] == st_b["glanced"] == 0 and st_b["hamming"] > 0
    csgd = FalconTrainOptions(noise=0.0, autocast=False, glance=0.0)
    assert loss(csgd, tables)[0] != loss(csgd, wrong_guesses)[0]
    # evaluation reads the guesses with either objective; with every guess wrong no block counts as right
    with torch.no_grad():
        st = sequence_loss(model, data, 0, ttt, wrong_guesses, train=False)[2]
    assert st["agree_pred_right"][1] == 0 and st["agree_pred"][1] > 0


def test_a_pack_of_sequences_gives_what_each_gives_alone(target32):
    """Sequences packed into one training forward (rows see their own sequence alone) give the sum of their losses,
    rows, gradients and agreement counts, with each objective; the rows are the ones ``row_counts`` foretells."""
    g = torch.Generator().manual_seed(1)
    lens = [(4, 19), (9, 6), (3, 30), (6, 2), (12, 11)]  # (prompt, answer); (6, 2): no loss row with k = 2
    items = [{"prompt_ids": torch.randint(10, 2000, (p,), generator=g).tolist(),
              "response_ids": torch.randint(10, 2000, (r,), generator=g).tolist()} for p, r in lens]
    data = teacher_features(target32, items, max_len=64, progress=False, taps=(3,))
    torch.manual_seed(0)
    model = with_taps(build_model(target32, torch.arange(512)), [3], target32)
    with torch.no_grad():
        model.tap_fuse.normal_(std=0.02)  # the lower layer counts
    tables = loss_tables(model)
    seqs, offsets = list(range(len(data))), [1, 0, 1, 1, 0][:len(data)]
    for opts, train in ((FalconTrainOptions(noise=0.0, autocast=False, glance=0.0), True),
                        (FalconTrainOptions(noise=0.0, autocast=False, ttt=True), True),
                        (FalconTrainOptions(noise=0.0, autocast=False, csgd=False), True),
                        (FalconTrainOptions(noise=0.0, autocast=False), False)):
        model.zero_grad()
        loss, rows, st = pack_loss(model, data, seqs, opts, tables, offsets, train=train)
        loss.backward()
        packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        alone = [sequence_loss(model, data, i, opts, tables, o, train=train) for i, o in zip(seqs, offsets)]
        alone = [r for r in alone if r is not None]
        sum(r[0] for r in alone).backward()
        assert torch.allclose(loss, sum(r[0] for r in alone), rtol=1e-4)
        assert rows == sum(r[1] for r in alone) == sum(
            row_counts(len(data.tokens[i]), data.answer_start[i], 2, opts.csgd or not train)[0] for i in seqs)
        for n, p in model.named_parameters():
            if p.grad is not None:
                assert (packed[n] - p.grad).norm() <= 1e-4 * p.grad.norm(), n
        for key in ("agree_true", "agree_pred", "hamming", "agree_pred_right"):
            if key in st:
                want = [r[2][key] for r in alone]
                total = [tuple(map(sum, zip(*js))) for js in zip(*want)] if key == "agree_true" else \
                    tuple(map(sum, zip(*want))) if isinstance(want[0], tuple) else sum(want)
                assert st[key] == total, key


def test_packs_cut_a_step_into_forwards_of_bounded_rows():
    seqs = [(0, 0, 50), (1, 1, 30), (2, 0, 90), (3, 1, 10), (4, 0, 10)]
    assert [[q[0] for q in p] for p in packs(seqs, 100)] == [[0, 1], [2, 3], [4]]
    assert [[q[0] for q in p] for p in packs(seqs, 40)] == [[0], [1], [2], [3, 4]]  # a long one alone
    assert [[q[0] for q in p] for p in packs(seqs, 0)] == [[0], [1], [2], [3], [4]]


def test_packed_training_steps_move_the_head_as_one_sequence_per_forward_does(target32):
    data = _features(target32)
    heads = []
    for pack_rows in (0, 10 ** 6):
        torch.manual_seed(0)
        model = build_model(target32, torch.arange(512))
        opts = FalconTrainOptions(steps=3, batch_tokens=96, warmup=1, save_every=100, val_fraction=0.2,
                                  autocast=False, noise=0.0, ttt=True, pack_rows=pack_rows)
        train(model, data, opts, progress=False, log=lambda m: None)
        heads.append(model.state_dict())
    for n, a in heads[0].items():
        assert (a.float() - heads[1][n].float()).norm() <= 1e-3 * (a.float().norm() + 1e-6), n


def test_source_caps_cut_only_the_named_sources_to_a_seeded_subset():
    from training.common import cap_sources

    items = [{"prompt_ids": [n], "response_ids": [1] * 10, "source": "synth" if n % 4 else "people"}
             for n in range(40)]
    capped = cap_sources(items, {"synth": 55}, seed=0)
    synth = [it for it in capped if it["source"] == "synth"]
    assert len(synth) == 6  # whole answers until the cap is passed: 60 tokens
    assert [it for it in capped if it["source"] == "people"] == [it for it in items if it["source"] == "people"]
    assert capped == [it for it in items if it in capped]  # in the items' order
    assert cap_sources(items, {"synth": 55}, seed=0) == capped and cap_sources(items, {"synth": 55}, seed=1) != capped
    assert cap_sources(items, {}, seed=0) == items
