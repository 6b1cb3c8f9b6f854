"""GLIDE + CAPE: the draft model's cross-attention contract, CAPE tree shapes, losslessness with the shipped
checkpoint, checkpoint errors, and a short real training run."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from core.sampling import SamplingParams
from drafters.base import create_drafter
from drafters.cape import PAPER_BINS, cape_tree, check_bins, expansion_size
from drafters.glide.drafter import GlideDrafter
from drafters.glide.model import (GlideCheckpointError, GlideConfig, GlideModel, block_mask, causal_visibility,
                                  default_checkpoint)
from server.engine import Engine
from tests.lossless import assert_lossless, tokens_per_step


@pytest.fixture(scope="module")
def random_glide(target32, tmp_path_factory):
    """An untrained GLIDE for the default target (random weights: for contracts, not for acceptance)."""
    from training.glide import build_model

    torch.manual_seed(0)
    model = build_model(target32, torch.arange(4096))
    for p in model.parameters():  # away from the target-layer init so every path carries signal
        p.data.add_(torch.randn_like(p) * 0.02)
    path = tmp_path_factory.mktemp("glide") / "glide.safetensors"
    model.save(path, {"note": "random"})
    return path


# -- the draft model --------------------------------------------------------------------------------------------
def test_block_mask_is_the_papers():
    for n, L, off in [(12, 5, 0), (17, 5, 3), (9, 1, 0), (6, 4, 2)]:
        m = block_mask(n, n, L, off)
        want = torch.tensor([[(j + off) // L > (k + off) // L for k in range(n)] for j in range(n)])
        assert torch.equal(m, want)
    m = block_mask(10, 10, 5)
    assert not m[:5].any() and m[5:, :5].all() and not m[5:, 5:].any()


def test_rope_follows_the_target_settings(tmp_path):
    from core.ops import LlamaArgs
    from server.engine.model import Llama
    from tests.conftest import write_tiny_llama

    for scaling in (None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}):
        d = tmp_path / str(bool(scaling))
        cfg = write_tiny_llama(d, hidden=32, heads=4, kv_heads=2, rope_scaling=scaling)
        args = LlamaArgs.from_hf(cfg)
        target = Llama(args, 256)
        glide = GlideModel(GlideConfig.for_target(args, "tiny", hidden_size=32, num_heads=4, num_kv_heads=2,
                                                  intermediate_size=64))
        assert glide.c.rope_theta == 500.0 and glide.c.rope_scaling == args.rope_scaling
        pos = torch.tensor([0, 3, 77, 200])
        x = torch.randn(4, 4, args.head_dim)
        assert torch.equal(glide.rope(x, pos), target.rope(x, pos))
    other = dataclasses.replace(args, rope_theta=10000.0)  # a different theta gives different rotations
    assert not torch.equal(glide.rope.cos, GlideModel(GlideConfig.for_target(
        other, "tiny", hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)).rope.cos)


def _tiny_glide(seed=0, **kw):
    from core.ops import LlamaArgs

    torch.manual_seed(seed)
    args = LlamaArgs(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                     head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True,
                     max_position_embeddings=128, bos_token_id=0, eos_token_ids=(1,))
    m = GlideModel(GlideConfig.for_target(args, "tiny", **kw))
    emb = torch.randn(50, 32)
    return m.attach(emb, emb), args


def test_training_mask_hides_the_current_and_later_blocks():
    m, args = _tiny_glide()
    T = 15
    ids = torch.randint(0, 50, (T,))
    k, v = torch.randn(2, T, 8), torch.randn(2, T, 8)
    vis = block_mask(T, T, 5)
    base = m(ids, torch.arange(T), None, 0, [(k, v)], vis)
    k2, v2 = k.clone(), v.clone()
    k2[:, 5:10] += 3.0  # change target KV of block 1 only
    v2[:, 5:10] -= 3.0
    out = m(ids, torch.arange(T), None, 0, [(k2, v2)], vis)
    assert torch.equal(out[:10], base[:10])  # blocks 0 and 1 never see block 1's keys
    assert not torch.allclose(out[10:], base[10:])  # block 2 does


def test_cross_attention_reads_only_visible_keys_and_reads_them():
    m, _ = _tiny_glide()
    T, n = 3, 6
    ids = torch.randint(0, 50, (T,))
    pos = torch.tensor([6, 7, 8])
    k, v = torch.randn(2, n + 4, 8), torch.randn(2, n + 4, 8)
    full = m(ids, pos, None, 0, [(k[:, :n], v[:, :n])], None)
    # Extra (unverified) keys past n, hidden by the visibility mask, change nothing ...
    masked = m(ids, pos, None, 0, [(k, v)], causal_visibility(pos, n + 4) & (torch.arange(n + 4) < n))
    assert torch.allclose(full, masked, atol=1e-6)
    # ... while a verified key does matter.
    k3 = k.clone()
    k3[:, 2] += 5.0
    assert not torch.allclose(m(ids, pos, None, 0, [(k3[:, :n], v[:, :n])], None), full)
    # The vanilla drafter has no cross-attention sub-layer at all.
    van, _ = _tiny_glide(cross_attention=False)
    assert not any("cq" in name for name, _ in van.named_parameters())


def test_drafter_ignores_unverified_target_cache(fp32_config, target32, random_glide):
    """Garbage in the target's KV slot past cache_len (draft rows of a previous tree) cannot reach the drafter."""
    trees = []
    for garbage in (False, True):
        drafter = GlideDrafter(target32, checkpoint=str(random_glide), gamma=4)
        engine = Engine(fp32_config, drafter, target32)
        seq = engine.add(list(range(20, 60)), max_new_tokens=8)
        engine.prefill(seq)
        if garbage:
            engine.pool.k[:, seq.slot, :, seq.cache_len:] = 7.0
            engine.pool.v[:, seq.slot, :, seq.cache_len:] = -7.0
        trees.append(drafter.propose(engine.view(seq)).tokens)
        engine.release(seq)
    assert trees[0] == trees[1]


def test_a_drafter_reads_the_target_layer_it_is_configured_for(fp32_config, target32, tmp_path):
    """read_layers=[L]: the cross-attention reads layer L's verified K/V and no other layer's; the choice survives a
    checkpoint round trip, and the cross-attention's projections start from layer L's."""
    from training.glide import build_model

    mid = target32.args.num_layers // 2
    with pytest.raises(ValueError, match="read_layers"):
        build_model(target32, torch.arange(512), read_layers=[mid, mid])  # one draft layer: one layer to read
    with pytest.raises(ValueError, match="read_layers"):
        build_model(target32, torch.arange(512), read_layers=[target32.args.num_layers])
    torch.manual_seed(0)
    model = build_model(target32, torch.arange(4096), read_layers=[mid])
    assert torch.equal(model.layers[0].cross_norm, target32.model.layers[mid].attn_norm)
    for p in model.parameters():
        p.data.add_(torch.randn_like(p) * 0.02)
    path = tmp_path / "glide-mid.safetensors"
    model.save(path, {"note": "random"})
    assert GlideModel.load(path).c.target_layer(0) == mid
    trees = {}
    for garbage in (None, mid, target32.args.num_layers - 1):
        drafter = GlideDrafter(target32, checkpoint=str(path), gamma=4)
        engine = Engine(fp32_config, drafter, target32)
        seq = engine.add(list(range(20, 60)), max_new_tokens=8)
        engine.prefill(seq)
        if garbage is not None:  # the verified positions of one layer
            engine.pool.k[garbage, seq.slot, :, :seq.cache_len] = 7.0
            engine.pool.v[garbage, seq.slot, :, :seq.cache_len] = -7.0
        trees[garbage] = drafter.propose(engine.view(seq)).tokens
        engine.release(seq)
    assert trees[target32.args.num_layers - 1] == trees[None]
    assert trees[mid] != trees[None]


# -- CAPE -------------------------------------------------------------------------------------------------------
def test_cape_expansion_sizes_follow_the_bins():
    assert [expansion_size(p) for p in (0.05, 0.3, 0.31, 0.6, 0.7, 0.8, 0.81, 1.0)] == [7, 7, 5, 5, 3, 3, 1, 1]
    bins = check_bins([[0.5, 2], [1.0, 0]])
    assert expansion_size(0.4, bins) == 2 and expansion_size(0.9, bins) == 0
    with pytest.raises(ValueError):
        check_bins([[0.6, 1], [0.5, 2]])
    with pytest.raises(ValueError):
        check_bins([[0.5, 1]])


def test_cape_tree_shape():
    chain = [10, 11, 12, 13]
    alts = [[100 + 10 * i + j for j in range(8)] for i in range(4)]
    conf = [0.9, 0.5, 0.2, 0.7]  # sizes 1, 5, 7, 3
    tree = cape_tree(1, chain, alts, conf, PAPER_BINS, max_rows=64)
    tree.validate(1000)
    assert tree.tokens[:5] == [1, *chain] and tree.parents[:5] == [-1, 0, 1, 2, 3]
    assert tree.num_rows == 1 + 4 + 1 + 5 + 7 + 3
    exp = list(zip(tree.tokens[5:], tree.parents[5:]))
    assert exp == ([(100, 0)] + [(110 + j, 1) for j in range(5)] + [(120 + j, 2) for j in range(7)]
                   + [(130 + j, 3) for j in range(3)])
    # Expansion tokens never get children: they are leaves.
    assert all(not tree.children()[r] for r in range(5, tree.num_rows))
    # The cap keeps the chain and the shallow expansions first.
    capped = cape_tree(1, chain, alts, conf, PAPER_BINS, max_rows=10)
    assert capped.num_rows == 10 and capped.tokens[:5] == [1, *chain]
    assert capped.parents[5:] == [0, 1, 1, 1, 1]
    assert cape_tree(1, chain, alts, conf, PAPER_BINS, max_rows=3).tokens == [1, 10, 11]
    q = torch.rand(4, 1000)
    tq = cape_tree(1, chain, alts, conf, PAPER_BINS, 64, chain_q=q).q
    assert torch.equal(tq[1:5], q) and not tq[0].any() and not tq[5:].any()


# -- losslessness with the shipped checkpoint (prompt_ids: tests/drafters/conftest.py) --------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["glide", "glide-cape"])
def test_shipped_checkpoint_is_lossless_greedy(fp32_config, target32, stops, prompt_ids, name):
    assert default_checkpoint(target32.model_id).is_file(), "the trained checkpoint must ship in the repository"
    plain = Engine(fp32_config, create_drafter("none", target32), target32)
    spec = Engine(fp32_config, create_drafter(name, target32), target32)
    outs = assert_lossless(spec, prompt_ids, plain, 48, stops, label=name)
    assert tokens_per_step(outs) > 1.2  # the trained drafter really drafts (an untrained one stays near 1.0)


def test_seeded_glide_cape_proposes_its_race_order_as_point_masses(fp32_config, target32, prompt_ids):
    """A seeded request's target draws by a race on clocks keyed on (seed, position); GLIDE runs the same race on its
    own distribution: the first chain token is its winner, the root's other children the next to ring."""
    from core.sampling import race, token_clocks

    drafter = create_drafter("glide-cape", target32)
    engine = Engine(fp32_config, drafter, target32)
    sp = SamplingParams(temperature=0.8, top_k=50, seed=1)
    seq = engine.add(prompt_ids[0], sp, max_new_tokens=16)
    engine.prefill(seq)
    view = engine.view(seq)
    tree = drafter.propose(view)
    assert tree.q is None  # point masses: accepted where they equal the target's draw
    q = drafter.review(view, [])[0]  # GLIDE's distribution after the root, over the whole vocabulary
    clocks = token_clocks(sp.seed, len(seq.token_ids), target32.args.vocab_size)
    first = [tree.tokens[c] for c in tree.children()[0]]
    assert first == race(q, clocks, len(first))
    engine.release(seq)


def test_sampled_glide_cape_hands_over_its_distributions(fp32_config, target32, prompt_ids):
    drafter = create_drafter("glide-cape", target32)
    engine = Engine(fp32_config, drafter, target32)
    seq = engine.add(prompt_ids[0], SamplingParams(temperature=0.8, top_k=50), max_new_tokens=16)
    engine.prefill(seq)
    tree = drafter.propose(engine.view(seq))
    tree.validate(target32.args.vocab_size)
    gamma = drafter.gamma
    q = tree.q
    assert torch.allclose(q[1:1 + gamma].sum(-1), torch.ones(gamma), atol=1e-5)
    for r in range(1, 1 + gamma):  # each chain token was drawn from its row (top-k 50: at most 50 tokens)
        assert q[r, tree.tokens[r]] > 0 and int((q[r] > 0).sum()) <= 50
    assert not q[1 + gamma:].any()  # expansions are point masses
    while seq.finish_reason is None:
        engine.step(seq)
    engine.release(seq)
    assert seq.num_generated == 16


def test_missing_or_mismatched_checkpoint_fails_clearly(target32, random_glide, tmp_path):
    with pytest.raises(GlideCheckpointError, match="specserve train glide"):
        GlideDrafter(target32, checkpoint=str(tmp_path / "nope.safetensors"))
    m = GlideModel.load(random_glide)
    m.c.target_id = "some-other-model"
    m.attach(target32.embed_weight, target32.lm_head_weight)
    m.save(tmp_path / "other.safetensors")
    with pytest.raises(GlideCheckpointError, match="trained for target 'some-other-model'.*specserve train glide"):
        GlideDrafter(target32, checkpoint=str(tmp_path / "other.safetensors"))
    m = GlideModel.load(random_glide)
    m.c.target_id, m.c.target_num_layers = target32.model_id, 12
    m.save(tmp_path / "shape.safetensors")
    with pytest.raises(GlideCheckpointError, match="target shapes"):
        GlideDrafter(target32, checkpoint=str(tmp_path / "shape.safetensors"))


# -- training ---------------------------------------------------------------------------------------------------
def test_a_few_training_steps_reduce_the_loss_and_checkpoints_reload(target32, tmp_path):
    from training.common import vocab_by_frequency
    from training.hf_reference import generate_responses
    from training.glide import TrainOptions, build_model, evaluate, loss_tables, train
    from training.prompts import training_records
    from training.teacher import teacher_pass

    recs = training_records(humaneval=False)[::200][:4]
    data = generate_responses(target32.hf_dir, target32.model_id, recs, tmp_path / "answers.pt", max_new_tokens=24,
                              batch_size=4, dtype=torch.float32, progress=False, gguf=target32.gguf)
    items = data["items"]
    assert len(items) == 4 and all(1 <= len(it["response_ids"]) <= 24 for it in items)
    vocab = vocab_by_frequency(items, target32.args.vocab_size, 512, always=(2,))
    assert 2 in vocab.tolist() and len(vocab) == 512
    model = build_model(target32, vocab)
    teacher = teacher_pass(target32, items, [model.c.target_layer(0)], 256, progress=False)
    opts = TrainOptions(steps=6, batch_tokens=48, lr=3e-3, warmup=1, val_fraction=0.0, save_every=3)
    head_t, local = loss_tables(model)
    idx = list(range(len(teacher)))
    before = evaluate(model, teacher, idx, opts, head_t, local)["loss"]
    train(model, teacher, opts, tmp_path / "state.pt", progress=False, log=lambda m: None)
    ev = evaluate(model, teacher, idx, opts, head_t, local, groups={"a": idx[:1], "b": idx[1:]})
    after = ev["loss"]
    assert after < before * 0.9, (before, after)
    # Per-group agreement: each group's own, and the groups weighted by their positions give the overall figure.
    n = [len(teacher.tokens[i]) - 1 - teacher.answer_start[i] for i in idx]
    one = evaluate(model, teacher, idx[:1], opts, head_t, local)["agreement"]
    assert ev["agreement_by_group"]["a"] == round(one, 4)
    mixed = (ev["agreement_by_group"]["a"] * n[0] + ev["agreement_by_group"]["b"] * sum(n[1:])) / sum(n)
    assert abs(mixed - ev["agreement"]) < 1e-3
    # Resuming a finished run is a no-op that keeps the weights.
    w = model.layers[0].wqkv.detach().clone()
    train(model, teacher, opts, tmp_path / "state.pt", progress=False, log=lambda m: None)
    assert torch.equal(model.layers[0].wqkv, w)
    # fp16 checkpoint: reloading gives the fp16-rounded model's outputs exactly, twice.
    path = tmp_path / "g.safetensors"
    model.save(path, {"steps": 6})
    ids, pos = teacher.tokens[0], torch.arange(len(teacher.tokens[0]))
    kv = teacher.kv[0].float()
    vis = block_mask(len(ids), len(ids), 5)
    outs = []
    for _ in range(2):
        m2 = GlideModel.load(path).attach(target32.embed_weight, target32.lm_head_weight)
        outs.append(m2.logits(m2(ids, pos, None, 0, [(kv[0, 0], kv[0, 1])], vis)))
    assert torch.equal(outs[0], outs[1])
    ref = GlideModel.load(path)
    ref.load_state_dict({k: v.half().float() if v.is_floating_point() else v for k, v in model.state_dict().items()},
                        strict=False)
    ref.attach(target32.embed_weight, target32.lm_head_weight)
    assert torch.equal(ref.logits(ref(ids, pos, None, 0, [(kv[0, 0], kv[0, 1])], vis)), outs[0])
    assert (path.with_suffix(".json")).read_text().strip().startswith("{")


def test_the_teacher_cache_computes_each_sequence_once_and_matches_the_pass(target32, tmp_path, monkeypatch):
    import training.teacher as tg

    g = torch.Generator().manual_seed(0)
    items = [{"prompt_ids": torch.randint(5, 1000, (p,), generator=g).tolist(),
              "response_ids": torch.randint(5, 1000, (r,), generator=g).tolist()}
             for p, r in ((6, 9), (3, 14), (8, 5), (4, 0), (40, 3), (5, 7))]  # item 3: no answer; 4: prompt too long
    computed = []
    real = tg.teacher_pass

    def counting(target, its, *a, **k):
        computed.extend(tg.teacher_key(it, 32) for it in its)
        return real(target, its, *a, **k)

    monkeypatch.setattr(tg, "teacher_pass", counting)
    layer = [target32.args.num_layers - 1]
    data, rows = tg.cached_teacher(target32, items[:3], layer, 32, tmp_path / "t", shard_size=2, progress=False)
    assert rows == [0, 1, 2] and len(computed) == 3
    ref = real(target32, items[:3], layer, 32, progress=False)
    for f in ("tokens", "answer_start", "kv", "hidden"):
        assert all(torch.equal(torch.as_tensor(x), torch.as_tensor(y))
                   for x, y in zip(getattr(data, f), getattr(ref, f))), f
    # More items, reordered, unusable ones among them: only the new usable one is computed.
    computed.clear()
    data2, rows2 = tg.cached_teacher(target32, [items[5], items[3], items[2], items[4], items[0]], layer, 32,
                                     tmp_path / "t", shard_size=2, progress=False)
    assert rows2 == [0, 2, 4] and computed == [tg.teacher_key(items[5], 32)]
    assert torch.equal(data2.hidden[1], ref.hidden[2]) and torch.equal(data2.kv[2], ref.kv[0])


def test_the_validation_split_stays_put_under_subsets_and_weights():
    from training.glide import TrainOptions, split_rows

    items = [{"prompt_ids": [i, i + 1], "response_ids": [7] * (10 + i % 5), "source": "chat" if i % 4 else "synth"}
             for i in range(200)]
    items += [{"prompt_ids": [0], "response_ids": [1] * 50, "source": "text:x.md"} for _ in range(3)]
    rows = list(range(len(items)))
    train, val = split_rows(items, rows, TrainOptions(val_fraction=0.1))
    assert 5 <= len(val) <= 40 and not set(train) & set(val) and len(train) + len(val) == len(items)
    sub, val2 = split_rows(items, rows, TrainOptions(val_fraction=0.1, train_tokens=100))
    assert val2 == val
    answers = [r for r in sub if not items[r]["source"].startswith("text:")]
    n = sum(len(items[r]["response_ids"]) for r in answers)
    assert 100 <= n < 100 + 15 and set(sub) <= set(train)
    assert {r for r in train if items[r]["source"].startswith("text:")} <= set(sub)  # shipped text stays whole
    heavy, val3 = split_rows(items, rows, TrainOptions(val_fraction=0.1, source_weights=(("synth", 3),)))
    assert val3 == val
    for r in train:
        assert heavy.count(r) == (3 if items[r]["source"] == "synth" else 1)


def test_training_prompts_hold_out_benchmarks():
    import json
    from pathlib import Path

    from training.prompts import humaneval_records, training_records

    train = training_records()
    texts = {json.dumps(r.get("messages") or r.get("prompt")) for r in train}
    held = humaneval_records("heldout")
    assert held and not texts & {json.dumps(r.get("messages") or r.get("prompt")) for r in held}
    bench = Path(__file__).resolve().parents[2] / "deploy" / "prompts" / "bench.jsonl"
    for line in bench.read_text().splitlines():
        r = json.loads(line)
        assert json.dumps(r.get("messages") or r.get("prompt")) not in texts


def test_glide_training_continues_from_a_checkpoint(fp32_config, random_answers, tmp_path):
    """``init``: the run starts from the checkpoint's weights and kept vocabulary (0 steps give it back as it was),
    then trains on; the card names the checkpoint; shape options cannot go with it."""
    from safetensors.torch import load_file

    from drafters.adaptive import checkpoint_digest
    from training.glide import TrainOptions, run_train_glide

    quiet = dict(data_path=random_answers, progress=False, log=lambda *a: None)
    opts = dict(batch_tokens=48, warmup=1, val_fraction=0.3, autocast=False, max_len=32)
    first = run_train_glide(fp32_config, tmp_path / "a.safetensors", opts=TrainOptions(steps=2, **opts),
                            vocab_subset=300, **quiet)
    same = run_train_glide(fp32_config, tmp_path / "b.safetensors", opts=TrainOptions(steps=0, **opts),
                           vocab_subset=100, init=first, **quiet)
    a, b = load_file(first), load_file(same)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    more = run_train_glide(fp32_config, tmp_path / "c.safetensors", opts=TrainOptions(steps=2, **opts), init=first,
                           **quiet)
    c = load_file(more)
    assert torch.equal(c["vocab_ids"], a["vocab_ids"]) and any(not torch.equal(c[n], a[n]) for n in a)
    card = json.loads(more.with_suffix(".json").read_text())
    assert card["training"]["init"] == {"file": "a.safetensors", "digest": checkpoint_digest(first)}
    with pytest.raises(ValueError, match="--init"):
        run_train_glide(fp32_config, tmp_path / "d.safetensors", opts=TrainOptions(steps=0, **opts), init=first,
                        num_layers=2, **quiet)
