"""A GGUF file's block matrices as the quantized targets read them (``server.engine.weights.gguf_linear_blocks``):
every type whose blocks of 32 are affine (Q4_0, Q4_1, Q4_K as 4-bit codes; Q5_0, Q5_K, Q8_0 as 8-bit ones),
de-quantized bit for bit as the ``gguf`` package's own ``dequantize``, for every family's GGUF architecture."""
from __future__ import annotations

import numpy as np
import pytest

from server.engine import weights as W
from server.gguf_file import BLOCK_NAMES

T_SIZES = {"Q4_0": 1, "Q4_1": 2, "Q5_0": 1, "Q8_0": 1, "Q4_K": 2, "Q5_K": 2, "Q6_K": 0}  # float16 fields up front


def random_raw(type_name: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """Random bytes of N rows of ``type_name`` blocks, the leading float16 scale fields made finite."""
    import gguf

    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (N, K // block * size), dtype=np.uint8)
    blocks = raw.reshape(N, K // block, size)
    n = T_SIZES[type_name]
    if n:
        blocks[..., :2 * n] = (rng.standard_normal((N, K // block, n)) * 0.01).astype(np.float16) \
            .view(np.uint8).reshape(N, K // block, 2 * n)
    else:  # Q6_K: its float16 d is the last two bytes
        blocks[..., -2:] = (rng.standard_normal((N, K // block, 1)) * 0.01).astype(np.float16) \
            .view(np.uint8).reshape(N, K // block, 2)
    return raw


def dequantized(q, d, m) -> np.ndarray:
    N, K = q.shape
    return (d[..., None] * np.asarray(q).reshape(N, K // 32, 32).astype(np.float32) + m[..., None]).reshape(N, K)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q8_0"])
def test_blocks_dequantize_as_gguf_does(type_name):
    import gguf

    bits, unpack = W._UNPACK[type_name]
    raw = random_raw(type_name, 16, 512)
    q, d, m = unpack(raw, 512)
    assert q.max() < 2 ** (4 if type_name.startswith("Q4") else 5 if type_name.startswith("Q5") else 8)
    assert bits == (4 if type_name.startswith("Q4") else 8)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    assert np.array_equal(dequantized(q, d, m), ref)


def test_a_qwen2_file_gives_its_blocks_under_transformers_names(tmp_path):
    """Each supported type under its transformers name, rows as stored (only llama.cpp's "llama" converter
    interleaves q/k rows); Q6_K (sub-blocks of 16) and float tensors left out."""
    import gguf

    path = tmp_path / "tiny-qwen2.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    layout = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q5_K",
              "ffn_up": "Q4_1", "ffn_down": "Q6_K"}
    raws = {}
    for i, (kind, type_name) in enumerate(layout.items()):
        raws[kind] = random_raw(type_name, 32, 256, seed=i)
        writer.add_tensor(f"blk.0.{kind}.weight", raws[kind], raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    got = W.gguf_linear_blocks(path)
    names = {k: f"model.layers.0.{BLOCK_NAMES['qwen2'][k]}.weight" for k in layout}
    assert set(got) == {names[k] for k in layout if k != "ffn_down"}
    for kind, type_name in layout.items():
        if kind == "ffn_down":
            continue
        b = got[names[kind]]
        ref = gguf.quants.dequantize(raws[kind], gguf.GGMLQuantizationType[type_name])
        assert np.array_equal(dequantized(b.q.numpy(), b.d.numpy(), b.m.numpy()), ref), kind
        assert b.bits == W._UNPACK[type_name][0]


@pytest.mark.parametrize("arch,types,want", [
    ("qwen2", ["Q4_K", "Q4_0"], "int4"), ("gemma3", ["Q4_1"], "int4"), ("qwen3", ["Q8_0"], "int8"),
    ("llama", ["Q4_K", "Q6_K"], None), ("qwen2", ["Q4_K", "Q8_0"], None), ("phi3", ["Q4_1"], None)])
def test_quantization_auto_reads_the_files_widths(tmp_path, arch, types, want):
    """``model.quantization: auto`` serves a GGUF file at its own width where every linear layer has one: 4-bit affine
    blocks (any of Q4_0, Q4_1, Q4_K) as int4, Q8_0 as int8; mixed widths (Q4_K_M) and other architectures: none."""
    import gguf

    path = tmp_path / "f.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    for i, type_name in enumerate(types):
        writer.add_tensor(f"blk.{i}.attn_q.weight", random_raw(type_name, 32, 256, seed=i),
                          raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert W.gguf_linear_quantization(path) == want
