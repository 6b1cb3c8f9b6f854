"""Weight-only int8/int4 targets (lossless speculation with respect to the quantized model) and `model.dtype: auto`."""
from __future__ import annotations

import json

import pytest
import torch

from core.ops import Int4Weight, Int8Weight, linear
from drafters.base import create_drafter
from server.config import config_from_dict
from server.engine import Engine, load_engine, load_target
from server.engine.quant import PackedLinear
from server.engine.stepcost import CHOICE_FILE, KERNELS_FILE, choose_dtype, choose_int4_form, machine_key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_matches_its_dequantized_matrix(dtype):
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    q = Int8Weight.quantize(w, dtype)
    assert q.q.dtype == torch.int8 and q.scale.dtype == dtype
    # round to nearest: half a step per channel, plus the 16-bit rounding of the scale itself (8 significant bits)
    err = (q.dequantize().float() - w).abs()  # [N, K]
    bound = q.scale.float()[:, None] / 2 + (w.abs() * 2**-7 if dtype == torch.bfloat16 else 1e-6)
    assert (err <= bound).all()
    x = torch.randn(5, 64).to(dtype)
    ref = x.float() @ q.dequantize().float().t()
    tol = 1e-4 if dtype == torch.float32 else 0.3  # bfloat16 activations and output: ~3 significant digits
    torch.testing.assert_close(linear(x, q).float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_weight_matches_its_dequantized_matrix(dtype):
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    q = Int4Weight.quantize(w, dtype, group=32)
    deq = q.dequantize().float()
    span = (w.view(48, 2, 32).amax(-1) - w.view(48, 2, 32).amin(-1)).max()
    assert (deq - w).abs().max() <= span / 15 / 2 * 1.01 + (0.05 if dtype == torch.bfloat16 else 1e-5)
    x = torch.randn(5, 64).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 0.3
    torch.testing.assert_close(linear(x, q).float(), x.float() @ deq.t(), atol=tol, rtol=tol)


def test_int4_from_gguf_style_blocks_is_exact():
    """A Q4_1 block (w = d * q + m) maps onto the packed layout without requantizing: scale d, zero m + 8 d."""
    torch.manual_seed(1)
    N, K, G = 16, 64, 32
    q = torch.randint(0, 16, (N, K), dtype=torch.int32)
    d, m = torch.rand(N, K // G) * 0.1, torch.randn(N, K // G) * 0.1
    w = (q.view(N, K // G, G) * d[..., None] + m[..., None]).view(N, K)
    packed = Int4Weight.from_groups(q, d, m, torch.float32, G)
    torch.testing.assert_close(packed.dequantize(), w, atol=1e-6, rtol=0)


def test_the_dense_int4_form_is_the_packed_matrix_multiplied_densely():
    torch.manual_seed(2)
    N, K, G = 32, 64, 32
    q = torch.randint(0, 16, (N, K), dtype=torch.int32)
    d, m = torch.rand(N, K // G) * 0.1, torch.randn(N, K // G) * 0.1
    packed, dense = (Int4Weight.from_groups(q, d, m, torch.float32, G, form) for form in ("packed", "dense"))
    assert (packed.form, dense.form) == ("packed", "dense")
    assert dense.packed.numel() == 0 and dense.q is None  # no second copy of the codes
    w = (q.view(N, K // G, G) * d[..., None] + m[..., None]).view(N, K)
    assert torch.equal(dense.dequantize(), w)
    x = torch.randn(5, K)
    torch.testing.assert_close(linear(x, dense), linear(x, packed), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="int4 form"):
        Int4Weight.from_groups(q, d, m, torch.float32, G, "sparse")


def test_the_int4_form_is_measured_once_and_remembered(tmp_path, monkeypatch):
    import server.engine.stepcost as stepcost

    form = choose_int4_form((64, 128), torch.float32, tmp_path)  # measured on this machine
    entry = json.loads((tmp_path / KERNELS_FILE).read_text())[machine_key("int4")]["int4 64x128 float32"]
    assert entry["form"] == form and set(entry["candidates"]) == {"packed", "dense"}
    assert all(ms > 0 for ms in entry["candidates"].values())

    def measure_again(*a, **k):
        raise AssertionError("measured twice")

    monkeypatch.setattr(stepcost, "measure_int4_forms", measure_again)
    assert choose_int4_form((64, 128), torch.float32, tmp_path) == form


def test_the_int4_target_serves_its_remembered_form_and_both_are_lossless(tiny_dir, tmp_path):
    """Whichever form the measurement left in the cache is the one served; speculation reproduces plain decoding on
    each, and the two compute the same model up to float32 sums."""
    import shutil

    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model_dir)
    cfg = config_from_dict({"model": {"source": str(model_dir), "dtype": "float32", "device": "cpu",
                                      "quantization": "int4"}, "cache": {"num_slots": 1, "max_seq_len": 64}})
    load_target(cfg, progress=False)  # measures, and remembers
    path = model_dir / KERNELS_FILE
    known = json.loads(path.read_text())
    (name, entry), = [(k, v) for k, v in known[machine_key("int4")].items() if k.startswith("int4 ")]
    logits = {}
    for form in ("packed", "dense"):
        entry["form"] = form
        path.write_text(json.dumps(known))
        target = load_target(cfg, progress=False)
        assert {w.form for w in target.model.matmul_weights()} == {form}, name
        plain = Engine(cfg, target=target)
        spec = Engine(cfg, create_drafter("ngram", target, {"num_tokens": 4, "max_ngram": 2}), target)
        for prompt in ([2, 3, 4, 2, 3, 4, 2, 3], [9, 10, 11]):
            assert spec.generate(prompt, max_new_tokens=16).token_ids == plain.generate(prompt, max_new_tokens=16).token_ids
        seq = plain.add([2, 3, 4, 5, 6])
        with torch.inference_mode():
            logits[form] = plain.logits(plain.forward(seq, [2, 3, 4, 5, 6], torch.arange(5)))
        plain.release(seq)
    torch.testing.assert_close(logits["dense"], logits["packed"], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=[("int8", "float32"), ("int4", "float32"), ("int8", "bfloat16")],
                ids=lambda p: "-".join(p))
def quant_cfg(request, tiny_dir):
    kind, dtype = request.param
    return config_from_dict({"model": {"source": str(tiny_dir), "dtype": dtype, "device": "cpu",
                                       "quantization": kind},
                             "cache": {"num_slots": 2, "max_seq_len": 64}})


def test_quantized_target_packs_every_linear_layer(quant_cfg):
    target = load_target(quant_cfg, progress=False)
    m = target.model
    for layer in m.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            assert isinstance(getattr(layer, name), PackedLinear)
    assert isinstance(m.lm_head, PackedLinear) and isinstance(m.embed.weight, torch.Tensor)
    assert tuple(target.lm_head_weight.shape) == (m.args.vocab_size, m.args.hidden_size)


def test_greedy_speculation_is_lossless_on_the_quantized_target(quant_cfg):
    """The quantized model is the target: ngram speculation must reproduce its own plain greedy decoding."""
    target = load_target(quant_cfg, progress=False)
    plain = Engine(quant_cfg, target=target)
    spec = Engine(quant_cfg, create_drafter("ngram", target, {"num_tokens": 4, "max_ngram": 2}), target)
    for prompt in ([2, 3, 4, 2, 3, 4, 2, 3], [5, 6, 7, 8, 5, 6], [9, 10, 11]):
        a = plain.generate(prompt, max_new_tokens=24).token_ids
        b = spec.generate(prompt, max_new_tokens=24)
        assert b.token_ids == a
    assert b.stats.draft_tokens > 0


def test_quantized_target_differs_from_the_float_one_but_stays_close(tiny_dir):
    base = {"source": str(tiny_dir), "dtype": "float32", "device": "cpu"}
    cfgs = {k: config_from_dict({"model": {**base, "quantization": k}, "cache": {"num_slots": 1, "max_seq_len": 64}})
            for k in ("none", "int8", "int4")}
    logits = {}
    for k, c in cfgs.items():
        e = load_engine(c)
        seq = e.add([2, 3, 4, 5, 6])
        with torch.inference_mode():
            logits[k] = e.logits(e.forward(seq, [2, 3, 4, 5, 6], torch.arange(5)))
        e.release(seq)
    scale = logits["none"].abs().max()
    assert not torch.equal(logits["int8"], logits["none"])
    assert (logits["int8"] - logits["none"]).abs().max() < 0.05 * scale
    assert (logits["int4"] - logits["none"]).abs().max() < 0.3 * scale


def test_choose_dtype_picks_the_lowest_score_and_remembers_it(tmp_path):
    calls = []

    def measure(dtype):  # a machine where float32 is faster at 1 row, bfloat16 at 8
        calls.append(dtype)
        return {1: 30.0, 8: 70.0} if dtype == "float32" else {1: 60.0, 8: 50.0}

    cpu = torch.device("cpu")
    assert choose_dtype(measure, cpu, "none", tmp_path) == "float32"  # 100 < 110
    assert calls == ["bfloat16", "float32"]
    saved = json.loads((tmp_path / CHOICE_FILE).read_text())
    assert saved[machine_key("none")]["dtype"] == "float32"
    assert choose_dtype(measure, cpu, "none", tmp_path) == "float32" and len(calls) == 2  # cached
    assert choose_dtype(lambda d: {1: 1.0 if d == "bfloat16" else 9.0}, cpu, "int8", tmp_path) == "bfloat16"
    assert len(json.loads((tmp_path / CHOICE_FILE).read_text())) == 2  # one entry per machine key


def test_dtype_auto_measures_the_real_target_and_caches_the_choice(tiny_dir, tmp_path):
    import shutil

    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model_dir)
    cfg = config_from_dict({"model": {"source": str(model_dir), "dtype": "auto", "device": "cpu"},
                            "cache": {"num_slots": 1, "max_seq_len": 400}})
    target = load_target(cfg, progress=False)
    saved = json.loads((model_dir / CHOICE_FILE).read_text())
    entry = saved[machine_key("none")]
    assert str(target.dtype) == f"torch.{entry['dtype']}"
    assert set(entry["candidates"]) == {"bfloat16", "float32"}
    for c in entry["candidates"].values():
        assert set(c["ms"]) == {"1", "8"} and all(v > 0 for v in c["ms"].values())
    out = Engine(cfg, target=target).generate([2, 3, 4], max_new_tokens=4)
    assert len(out.token_ids) == 4
    for ctx in (32, 5):  # contexts shorter than the usual 300 + 8 measuring positions still measure
        short = config_from_dict({"model": {"source": str(model_dir), "dtype": "auto", "device": "cpu",
                                            "quantization": "int8" if ctx == 32 else "int4"},
                                  "cache": {"num_slots": 1, "max_seq_len": ctx}})
        assert load_engine(short).generate([2, 3], max_new_tokens=2).finish_reason == "length"


def test_auto_quantization_is_a_gguf_files_own_on_cpu_and_none_otherwise(tiny_dir):
    from server.engine.quant import resolve_quantization
    from server.model_files import resolve_model

    gguf = resolve_model("embedded", progress=False).gguf
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", cpu, gguf) == "int4"  # its block layers are Q4_1
    assert resolve_quantization("auto", cpu, None) == "none"  # a Hugging Face directory: quantizing would change it
    assert resolve_quantization("auto", cuda, gguf) == "none"
    for kind in ("none", "int8", "int4"):
        assert resolve_quantization(kind, cpu, gguf) == kind
    cfg = config_from_dict({"model": {"source": str(tiny_dir), "dtype": "float32", "device": "cpu",
                                      "quantization": "auto"}, "cache": {"num_slots": 1, "max_seq_len": 32}})
    target = load_target(cfg, progress=False)
    assert target.quantization == "none" and isinstance(target.model.layers[0].wqkv.weight, torch.Tensor)
