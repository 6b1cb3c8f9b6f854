"""Every supported decoder family (``core.ops.FAMILIES``) on a tiny random checkpoint written by transformers itself:
served in float32, greedy output equals transformers' ``generate`` token for token, plain and speculative (every
drafter that needs no training, and random draft trees), batched equals alone, a prefix hit equals a miss, the
quantized targets and the batched kernel layout run it; and checkpoints it cannot serve fail at start, by name."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from core.ops import FAMILIES, LlamaArgs, UnsupportedModel
from drafters.base import create_drafter
from server.config import config_from_dict
from server.engine import Engine, StepPlan, load_engine, load_target
from tests.engine.tree_drafters import OracleTreeDrafter
from tests.lossless import assert_lossless, plain_tokens, tokens_per_step

V = 96
MAX_LEN = 160
MAX_NEW = 20
WINDOW = 24  # Mistral's and Gemma 3's sliding window: shorter than most prompts, so every path meets it


def _config(family: str):
    """A transformers config of ``family`` small enough for a unit test, with each family's changes switched on:
    Llama 3.1's RoPE scaling, Mistral's sliding window, Qwen3's head_dim != hidden / heads, Gemma 3's sliding
    layers with their own RoPE base and a softmax scale that is not head_dim ** -0.5."""
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                  pad_token_id=1)
    if family == "llama":
        return tf.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, tie_word_embeddings=False)
    if family == "mistral":
        return tf.MistralConfig(**common, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False)
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    if family == "gemma3_text":
        return tf.Gemma3TextConfig(**{**common, "num_key_value_heads": 1}, head_dim=32, query_pre_attn_scalar=24,
                                   sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                    "full_attention": {"rope_type": "default",
                                                                       "rope_theta": 10000.0}})
    raise ValueError(family)


def write_tiny(path, family: str, seed: int = 0) -> dict:
    """A random ``family`` checkpoint saved by transformers (config.json + model.safetensors) into ``path``. Biases
    and norm weights are random too (transformers starts them at 0 or 1, where a missing one would go unnoticed),
    and the head is scaled so each greedy choice has a margin over float rounding."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
        head = model.get_output_embeddings().weight
        head.mul_(4.0 / head.std())
    model.save_pretrained(str(path))
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    """(family, checkpoint directory, float32 config, target, transformers' model)."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp(f"tiny-{request.param}")
    write_tiny(d, request.param)
    cfg = config_from_dict({"model": {"source": str(d), "dtype": "float32", "device": "cpu"},
                            "cache": {"num_slots": 4, "max_seq_len": MAX_LEN}})
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return request.param, d, cfg, load_target(cfg, progress=False), hf


def _prompts(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(2, V, (int(k),), generator=g).tolist() for k in torch.randint(8, 60, (n,), generator=g)]
    out[-1] = (out[-1][:6] * 5)[:30]  # a repetitive prompt, where the n-gram drafters find drafts
    return out


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=1, temperature=None, top_p=None, top_k=None)
    return out[0, len(ids):].tolist()


def test_logits_match_transformers(tiny):
    family, _, cfg, target, hf = tiny
    assert target.args.family == family
    engine = Engine(cfg, target=target)
    ids = _prompts(1, seed=2)[0] + list(range(2, 90))  # past the sliding layers' short RoPE wavelengths
    seq = engine.add(ids)
    try:
        with torch.inference_mode():
            ours = engine.model.logits(engine.forward(seq, ids, torch.arange(len(ids))))
            ref = hf(torch.tensor([ids])).logits[0]
    finally:
        engine.release(seq)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_equals_transformers_generate(tiny):
    _, _, cfg, target, hf = tiny
    engine = Engine(cfg, target=target)
    prompts = _prompts()
    ours = plain_tokens(engine, prompts, MAX_NEW)
    assert ours == [_hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize("drafter", ["ngram", "oracle-trees"])
def test_speculative_greedy_equals_plain(tiny, drafter):
    """The drafter that needs no training (`ngram`; `maxgram` reads a bigram table built from the target), and random trees that hide the true continuation (so deep paths are
    accepted and compacted)."""
    _, _, cfg, target, _ = tiny
    prompts = _prompts()
    plain = plain_tokens(Engine(cfg, target=target), prompts, MAX_NEW)
    if drafter == "oracle-trees":
        d = OracleTreeDrafter({tuple(p): w for p, w in zip(prompts, plain)}, kinds=("chain", "bushy"), max_rows=16,
                              vocab_size=V)
    else:
        d = create_drafter(drafter, target)
    outs = assert_lossless(Engine(cfg, d, target), prompts, plain, MAX_NEW, label=drafter)
    if drafter == "oracle-trees":
        assert tokens_per_step(outs) > 1.5


def test_batched_equals_alone(tiny):
    """Four sequences stepped together (decode steps and draft trees in one forward) return what each returns
    alone."""
    _, _, cfg, target, _ = tiny
    prompts = _prompts(4, seed=3)
    alone = plain_tokens(Engine(cfg, target=target), prompts, MAX_NEW)
    engine = Engine(cfg, OracleTreeDrafter({tuple(p): w for p, w in zip(prompts, alone)}, kinds=("chain", "bushy"),
                                           max_rows=8, vocab_size=V), target)
    assert _together(engine, prompts) == alone


def _together(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt's greedy output with all sequences stepped in one forward per step."""
    seqs = [engine.add(p, max_new_tokens=MAX_NEW) for p in prompts]
    for s in seqs:
        engine.prefill(s)
    while any(s.finish_reason is None for s in seqs):
        engine.run(StepPlan(decode=[s for s in seqs if s.finish_reason is None]))
    for s in seqs:
        engine.release(s)
    return [s.output_ids for s in seqs]


def test_a_prefix_hit_equals_a_miss(tiny):
    _, _, cfg, target, _ = tiny
    on = Engine(cfg, target=target)
    off = Engine(dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, prefix_caching=False)), target=target)
    first = _prompts(1, seed=4)[0]
    answer = on.generate(first, None, MAX_NEW).token_ids
    for prompt in (first, first + answer + [5, 6, 7]):
        before = on.prefix.hits
        got = on.generate(prompt, None, MAX_NEW).token_ids
        assert on.prefix.hits - before >= len(first) // 2, "no hit"
        assert got == off.generate(prompt, None, MAX_NEW).token_ids


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_target_is_lossless(tiny, quantization):
    """The quantized target (the qlinear kernel where the CPU has it, PyTorch's packed kernels elsewhere) serves every
    family, and speculation is lossless against it."""
    family, d, _, _, _ = tiny
    cfg = config_from_dict({"model": {"source": str(d), "dtype": "float32", "device": "cpu",
                                      "quantization": quantization},
                            "cache": {"num_slots": 2, "max_seq_len": MAX_LEN}})
    target = load_target(cfg, progress=False)
    prompts = _prompts()
    plain = plain_tokens(Engine(cfg, target=target), prompts, MAX_NEW)
    drafter = OracleTreeDrafter({tuple(p): w for p, w in zip(prompts, plain)}, kinds=("chain", "bushy"), max_rows=16,
                                vocab_size=V)
    assert tokens_per_step(assert_lossless(Engine(cfg, drafter, target), prompts, plain, MAX_NEW)) > 1.5


def test_the_batched_kernel_layout_equals_each_sequence_alone(tiny):
    """The CUDA path's batched Triton attention (under the interpreter here) on every family's rows."""
    from core.tree import DraftTree

    _, _, cfg, target, _ = tiny
    engine = Engine(cfg, target=target)
    a, b = (engine.add(p, max_new_tokens=8) for p in _prompts(2, seed=5))
    for s in (a, b):
        engine.prefill(s)
    parts = [engine._tree_rows(a, DraftTree.root_only(a.token_ids[-1])),
             engine._tree_rows(b, DraftTree([b.token_ids[-1], 3, 4, 5], [-1, 0, 0, 1]))]
    try:
        with torch.inference_mode():
            alone = torch.cat([engine.forward_rows([p]) for p in parts])
            ids = torch.tensor([t for p in parts for t in p[1]])
            kernel = engine.model(ids, torch.cat([p[2] for p in parts]), [], engine.layout.kernel_group(parts))
    finally:
        engine.release(a)
        engine.release(b)
    torch.testing.assert_close(kernel, alone, atol=1e-5, rtol=1e-5)


# -- what cannot be served fails at start, naming the cause ---------------------------------------------------------
def test_an_unsupported_architecture_names_itself_and_the_supported_list(tmp_path):
    write_tiny(tmp_path, "llama")
    c = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, "model_type": "mamba"}))
    cfg = config_from_dict({"model": {"source": str(tmp_path), "dtype": "float32", "device": "cpu"}})
    with pytest.raises(UnsupportedModel, match="model_type='mamba'.*supported: llama, mistral, qwen2, qwen3"):
        load_target(cfg, progress=False)


def test_a_context_longer_than_the_model_fails_at_start_and_a_window_is_read(tmp_path):
    c = write_tiny(tmp_path, "llama")
    args = LlamaArgs.from_hf(c)
    with pytest.raises(UnsupportedModel, match="longer than the model's context .256"):
        args.check_context(257)
    args.check_context(256)
    assert args.window is None
    mistral = LlamaArgs.from_hf({**c, "model_type": "mistral", "sliding_window": 64})
    assert mistral.sliding_layers == (0, 1) and mistral.window == 64
    mistral.check_context(256)  # past its window: the sliding layers attend through it
    gemma = LlamaArgs.from_hf(json.loads(_config("gemma3_text").to_json_string()))
    assert gemma.sliding_layers == (0,) and gemma.layer_rope == (True, False) and gemma.window == WINDOW
    qwen = LlamaArgs.from_hf({**c, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32,
                              "max_window_layers": 1})
    assert qwen.sliding_layers == (1,) and qwen.window == 32


def test_the_cli_says_why_a_model_cannot_be_served(tmp_path, capsys):
    from specserve.cli import main

    write_tiny(tmp_path, "qwen2")
    c = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, "model_type": "gpt2"}))
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {{source: {tmp_path}, dtype: float32, device: cpu}}\n")
    assert main(["generate", "--config", str(cfg), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "model_type='gpt2'" in err and "Traceback" not in err


# -- the checkpoint's own interface -----------------------------------------------------------------------------------
def test_generation_config_adds_the_end_of_turn_ids(tmp_path):
    """Chat models list their end-of-turn tokens in generation_config.json (Llama 3's <|eot_id|>): they stop there."""
    from server.model_files import load_hf_config

    write_tiny(tmp_path, "llama")
    assert LlamaArgs.from_hf(load_hf_config(tmp_path)).eos_token_ids == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7, 9]}))
    args = LlamaArgs.from_hf(load_hf_config(tmp_path))
    assert args.eos_token_ids == (1, 7, 9)
    cfg = config_from_dict({"model": {"source": str(tmp_path), "dtype": "float32", "device": "cpu"},
                            "cache": {"num_slots": 1, "max_seq_len": 64}})
    engine = load_engine(cfg)
    prompt = _prompts(1)[0]
    free = engine.generate(prompt, None, 12).token_ids
    stop = free[3]
    out = engine.generate(prompt, None, 12, stop_token_ids=args.eos_token_ids + (stop,))
    assert out.token_ids == free[:free.index(stop) + 1] and out.finish_reason == "stop"


def test_a_hub_snapshot_is_named_by_its_repository(tmp_path):
    from server.model_files import resolve_model

    snap = tmp_path / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "7ae557604adf67be50417f59c2c2f167def9a775"
    snap.mkdir(parents=True)
    write_tiny(snap, "qwen2")
    assert resolve_model(str(snap)).model_id == "Qwen/Qwen2.5-0.5B-Instruct"
    plain = tmp_path / "my-model"
    plain.mkdir()
    c = write_tiny(plain, "qwen2")
    assert resolve_model(str(plain)).model_id == "my-model"  # saved locally: _name_or_path is no hub name
    (plain / "config.json").write_text(json.dumps({**c, "_name_or_path": "Qwen/Qwen3-0.6B"}))
    assert resolve_model(str(plain)).model_id == "Qwen/Qwen3-0.6B"


# -- memory: no second copy of the weights --------------------------------------------------------------------------
def test_the_dtype_measurement_holds_no_copy_of_the_weights(tmp_path):
    """``model.dtype: auto`` measures on the target's first layers around its own tensors (float32: the very same
    storage), and casting that model for the bfloat16 candidate leaves the target in float32."""
    from server.engine.startup import AUTO_LAYERS, measure_dtype, measurement_model

    d = tmp_path / "deep"
    d.mkdir()
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM

    torch.manual_seed(0)
    c = _config("gemma3_text").to_dict()
    c.update(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    Gemma3ForCausalLM(Gemma3TextConfig(**c)).save_pretrained(str(d))
    cfg = config_from_dict({"model": {"source": str(d), "dtype": "float32", "device": "cpu"},
                            "cache": {"num_slots": 1, "max_seq_len": 64}})
    target = load_target(cfg, progress=False)
    model = target.model
    small = measurement_model(model, 64)
    assert len(small.layers) == AUTO_LAYERS < len(model.layers) and small.args.sliding_layers == (0, 1, 2, 3)
    mine = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in small.parameters()} <= mine  # nothing copied
    before = {n: p.clone() for n, p in model.named_parameters()}
    curve = measure_dtype(cfg, model, resolve_model_for(cfg), torch.device("cpu"), "bfloat16")
    assert set(curve) == {1, 8}
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert type(model.layers[0].wqkv).__name__ == "Linear"  # the target's own layers were not swapped


def resolve_model_for(cfg):
    from server.model_files import resolve_model

    return resolve_model(cfg.model.source, cfg.model.cache_dir, progress=False)


@pytest.mark.slow
def test_loading_with_a_dtype_measurement_holds_the_weights_once(tmp_path):
    """``model.dtype: auto`` on a 32-layer, 270 MiB float32 checkpoint, in a process of its own: the anonymous memory
    loading takes stays within 1.3x the weights (a deep copy per candidate dtype took 2x). What it may add: the
    measurement's few layers in bfloat16, and the kernel choice's random matrices of one layer's shapes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=4000, hidden_size=384, intermediate_size=1536, num_hidden_layers=32,
                                 num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
                                 max_position_embeddings=1024)).save_pretrained(str(tmp_path))
    weights = (tmp_path / "model.safetensors").stat().st_size / 2**20
    out = subprocess.run([sys.executable, "-m", "tests.engine._load_memory", str(tmp_path), "auto"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2],
                         env={**os.environ}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    took = json.loads(out.stdout.strip().splitlines()[-1])
    assert took["peak_mib"] <= 1.3 * weights and took["end_mib"] <= 1.3 * weights, (took, weights)


def test_bfloat16_speculation_through_a_sliding_window_equals_plain(tiny):
    """The 16-bit decode form through the window: a draft row reads the keys, padding and window the decode step at
    its position reads, so speculative greedy output equals plain greedy output token for token past the window
    (random trees: chain rows in place, branch rows gathered; decode steps of several sequences in one call)."""
    family, d, _, _, _ = tiny
    if family not in ("mistral", "gemma3_text"):
        pytest.skip("no sliding window")
    cfg = config_from_dict({"model": {"source": str(d), "dtype": "bfloat16", "device": "cpu"},
                            "cache": {"num_slots": 4, "max_seq_len": MAX_LEN}})
    target = load_target(cfg, progress=False)
    prompts = [p for p in _prompts(4, seed=6) if len(p) + MAX_NEW > WINDOW]
    plain = plain_tokens(Engine(cfg, target=target), prompts, MAX_NEW)
    drafter = OracleTreeDrafter({tuple(p): w for p, w in zip(prompts, plain)}, kinds=("chain", "bushy"), max_rows=16,
                                vocab_size=V)
    assert tokens_per_step(assert_lossless(Engine(cfg, drafter, target), prompts, plain, MAX_NEW)) > 1.5
    # decode steps of every sequence in one call (make_decode_group_attention)
    assert _together(Engine(cfg, target=target), prompts) == plain
