"""int4 served from a GGUF file's own Q4_1 blocks (server.engine.weights.gguf_linear_blocks, quantize_model(gguf=)).

Two files: the embedded model (Q4_1 from llama.cpp's min/max quantizer, so every block uses the codes 0 and 15 and
re-quantizing its de-quantized weights happens to give the same blocks back), and a small Llama written here whose
blocks do not span the codes (as a quantizer that fits scale and min leaves them), where re-quantizing is lossy and
only the file's blocks give the file's model.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from server.config import config_from_dict
from server.engine import Engine, Target, load_target
from server.engine.quant import INT4_GROUP, PackedLinear, int4_from_blocks, quantize_model
from server.engine.weights import QBlocks, gguf_linear_blocks, load_state_dict
from server.model_files import resolve_model
from tests.conftest import write_tiny_llama
from tests.engine.test_model import _logits

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
FUSED = {"wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "wo": ("self_attn.o_proj",),
         "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"), "w_down": ("mlp.down_proj",)}  # Llama.load_hf_state_dict


def dequantize_blocks(b: QBlocks) -> torch.Tensor:
    """W = d * q + m in float32, per block of 32 columns (the order of operations of gguf's own de-quantizer); for
    Q8_0's codes q = w + 128 that is d * w."""
    N, K = b.q.shape
    q = b.q.float().view(N, K // 32, 32)
    if b.bits == 8:
        return ((q - 128) * b.d[..., None]).view(N, K)
    return (q * b.d[..., None] + b.m[..., None]).view(N, K)


def fused(dense: dict[str, torch.Tensor], layer: int, name: str) -> torch.Tensor:
    return torch.cat([dense[f"model.layers.{layer}.{n}.weight"] for n in FUSED[name]])


def quantized_copy(model, gguf, kernels: str | None = "aten") -> torch.nn.Module:
    """A float32 int4 copy of a dense float32 target model, as the engine builds it (on PyTorch's packed kernels
    unless ``kernels`` says otherwise: their float32 activations make the file's model comparable to float32
    summation order; the qlinear kernel's int8 activations are tested in tests/kernels/test_qlinear.py)."""
    model = copy.deepcopy(model)
    quantize_model(model, "int4", torch.float32, gguf=gguf, kernels=kernels)
    return model


# -- the embedded model ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resolved():
    return resolve_model("embedded", progress=False)


@pytest.fixture(scope="module")
def blocks(resolved) -> dict[str, QBlocks]:
    return gguf_linear_blocks(resolved.gguf)


@pytest.fixture(scope="module")
def dense(hf_model32) -> dict[str, torch.Tensor]:
    """The weights transformers de-quantized from the same file."""
    return hf_model32.state_dict()


@pytest.fixture(scope="module")
def int4_target(target32, resolved) -> Target:
    m = quantized_copy(target32.model, resolved.gguf)
    return Target(m, target32.model_id, target32.device, torch.float32, target32.hf_dir)


def test_the_reader_returns_every_quantized_matrix_and_nothing_else(resolved, blocks, dense):
    layers = 1 + max(int(k.split(".")[2]) for k in dense if k.startswith("model.layers."))
    # the linear layers are Q4_1, the embedding (which the tied head multiplies by) Q8_0; the norms (F32) are left out
    linear = {f"model.layers.{i}.{n}.weight" for i in range(layers) for n in LINEARS}
    assert set(blocks) == linear | {"model.embed_tokens.weight"}
    for name, b in blocks.items():
        N, K = dense[name].shape
        assert b.q.shape == (N, K) and b.q.dtype == torch.uint8 and b.bits == (4 if name in linear else 8)
        assert int(b.q.max()) <= (15 if b.bits == 4 else 255)
        assert b.d.shape == b.m.shape == (N, K // 32) and b.d.dtype == b.m.dtype == torch.float32
    assert resolve_model(str(resolved.gguf), progress=False).gguf == resolved.gguf  # a .gguf path as the source too


@pytest.mark.parametrize("layer", [0, 17])
def test_the_files_blocks_are_transformers_weights_bit_for_bit(blocks, dense, layer):
    """Nibble order, d and m, and the q/k row order (llama.cpp's RoPE interleave undone) as transformers has them."""
    for n in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
        name = f"model.layers.{layer}.{n}.weight"
        w = dequantize_blocks(blocks[name])
        assert torch.equal(w, dense[name]), f"{name}: max |diff| {(w - dense[name]).abs().max().item():.3g}"
    # the Q8_0 embedding: d * (q - 128) as codes q = w + 128, m = -128 d
    assert torch.equal(dequantize_blocks(blocks["model.embed_tokens.weight"]), dense["model.embed_tokens.weight"])


@pytest.mark.parametrize("layer", [0, 29])
def test_int4_from_the_files_blocks_is_exactly_the_files_model(int4_target, dense, layer):
    for name in FUSED:
        w = getattr(int4_target.model.layers[layer], name).weight
        assert w.q is None  # held by the packed CPU kernel (N % 16 == 0); dequantize() runs through that kernel
        assert torch.equal(w.dequantize(), fused(dense, layer, name)), name


def test_bfloat16_scales_round_the_files_weights_within_bfloat16_precision(blocks, dense):
    """With bfloat16 activations the kernel takes (scale, zero) in bfloat16, so d, m + 8 d and the result are each
    rounded to 8 significant bits. Measured over the whole embedded model: max |diff| 0.031 (on a weight of 4.97), rms
    4.8e-4; plain bfloat16 rounding of the dense weights: max 0.014, rms 2.6e-4."""
    for name in [f"model.layers.{i}.{n}.weight" for i in (0, 29) for n in LINEARS]:
        b, w = blocks[name], dense[name]
        got = int4_from_blocks([b], w, torch.bfloat16).dequantize().float()
        scale, zero = (x.repeat_interleave(INT4_GROUP, dim=1) for x in (b.d, b.m + 8 * b.d))  # [N, K]
        # half a bfloat16 step (2^-8 relative: 8 significant bits) on the scale, the zero and the result
        bound = (8 * scale + zero.abs() + w.abs()) * 2.0 ** -8 * 1.001
        assert ((got - w).abs() <= bound).all(), name
        assert not torch.equal(got, w), name


def test_logits_of_the_int4_model_are_the_files_up_to_float32_sums(fp32_config, target32, tokenizer, int4_target):
    """End to end: every block layer is the file's; only the head (tied to the Q8_0 embedding, so no Q4_1 blocks) is
    re-quantized to int4. Against the dense model with that same head the logits agree to float32 summation order
    (measured 6e-5 on logits up to 27); the int4 head itself moves them by up to 3.8 (an int8 head: 0.47)."""
    ids = tokenizer("The capital of France is")["input_ids"]
    same_head = copy.deepcopy(target32.model)
    same_head.lm_head = int4_target.model.lm_head
    ref = Target(same_head, target32.model_id, target32.device, torch.float32, target32.hf_dir)
    diff = (_logits(Engine(fp32_config, target=int4_target), ids) - _logits(Engine(fp32_config, target=ref), ids))
    assert diff.abs().max() < 1e-3


# -- a file whose blocks re-quantizing would not reproduce ---------------------------------------------------------

def _q4_1_bytes(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    """q [N, K], d and m [N, K / 32] -> the file's bytes [N, K / 32 * 20]: float16 d, float16 m, 16 bytes whose low
    nibbles are a block's elements 0..15 and high nibbles 16..31."""
    N, K = q.shape
    qb = q.to(torch.uint8).view(N, K // 32, 32)
    nibbles = qb[..., :16] | (qb[..., 16:] << 4)  # [N, K / 32, 16]
    dm = torch.stack([d.half(), m.half()], dim=-1).view(torch.uint8)  # [N, K / 32, 4]
    return torch.cat([dm, nibbles], dim=-1).reshape(N, -1).numpy()


def _rope_interleave(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's row order for q_proj / k_proj (its ``permute``)."""
    return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    """A small untied Llama whose linear weights are exactly Q4_1 blocks with codes 1..14 (d * q + m), as an HF
    directory and as a GGUF file holding those blocks. -> (HF dir, GGUF path, {name: QBlocks})."""
    import gguf

    root = tmp_path_factory.mktemp("tiny-q4")
    hf = root / "hf"
    hf.mkdir()
    heads, kv_heads, layers = 4, 2, 2
    write_tiny_llama(hf, vocab_size=32, hidden=64, layers=layers, heads=heads, kv_heads=kv_heads, tie=False)
    state = load_state_dict(hf)
    gen = torch.Generator().manual_seed(0)
    names = [f"model.layers.{i}.{n}.weight" for i in range(layers) for n in LINEARS] + ["lm_head.weight"]
    own = {}
    for name in names:
        N, K = state[name].shape
        q = torch.randint(1, 15, (N, K), generator=gen, dtype=torch.uint8)
        d = (0.02 + 0.03 * torch.rand(N, K // 32, generator=gen)).half().float()
        m = (-7.5 * d + 0.01 * torch.randn(N, K // 32, generator=gen)).half().float()
        own[name] = QBlocks(q, d, m, 4)
        state[name] = dequantize_blocks(own[name])
    save_file(state, str(hf / "model.safetensors"))

    path = root / "tiny.Q4_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    to_gguf = {n: k for k, n in [("attn_q", LINEARS[0]), ("attn_k", LINEARS[1]), ("attn_v", LINEARS[2]),
                                 ("attn_output", LINEARS[3]), ("ffn_gate", LINEARS[4]), ("ffn_up", LINEARS[5]),
                                 ("ffn_down", LINEARS[6])]}
    for name, b in own.items():
        parts = name.split(".")  # model.layers.<i>.<module>.<proj>.weight
        gname = ("output.weight" if name == "lm_head.weight"
                 else f"blk.{parts[2]}.{to_gguf[parts[3] + '.' + parts[4]]}.weight")
        n_head = {"q_proj": heads, "k_proj": kv_heads}.get(parts[-2])
        q, d, m = (b[:3] if n_head is None else (_rope_interleave(x, n_head) for x in b[:3]))
        raw = _q4_1_bytes(q, d, m)
        # the encoder above is checked against gguf's own de-quantizer, not against the reader under test
        assert np.array_equal(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1),
                              dequantize_blocks(QBlocks(q, d, m, 4)).numpy())
        writer.add_tensor(gname, raw, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_norm.weight", state["model.layers.0.input_layernorm.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf, path, own


def test_the_reader_returns_a_files_blocks_as_written(tiny_q4):
    _, path, own = tiny_q4
    got = gguf_linear_blocks(path)
    assert set(got) == set(own)  # the untied head included; the float32 embedding and norm left out
    for name, b in own.items():
        assert all(torch.equal(x, y) for x, y in zip(got[name][:3], b[:3])) and got[name].bits == 4, name


def test_int4_from_blocks_that_requantizing_would_change_is_exactly_the_files_model(tiny_q4):
    hf, path, _ = tiny_q4
    cfg = config_from_dict({"model": {"source": str(hf), "dtype": "float32", "device": "cpu"},
                            "cache": {"num_slots": 1, "max_seq_len": 64}})
    target = load_target(cfg, progress=False)  # dense float32: the file's model
    dense = load_state_dict(hf)
    models = {"blocks": quantized_copy(target.model, path), "requantized": quantized_copy(target.model, None)}
    for kind, model in models.items():
        for i, layer in enumerate(model.layers):
            for name in FUSED:
                w = getattr(layer, name).weight.dequantize()
                assert torch.equal(w, fused(dense, i, name)) == (kind == "blocks"), (kind, i, name)
        assert isinstance(model.lm_head, PackedLinear)
        assert torch.equal(model.lm_head.weight.dequantize(), dense["lm_head.weight"]) == (kind == "blocks")

    ids = [3, 7, 1, 9, 4, 4, 12, 30]
    ref = _logits(Engine(cfg, target=target), ids)
    diff = {k: (_logits(Engine(cfg, target=Target(m, target.model_id, target.device, torch.float32, hf)), ids) - ref)
            .abs().max().item() for k, m in models.items()}
    # measured: blocks 0 (bit for bit), requantized 0.81, on logits up to 4.5
    assert diff["blocks"] < 1e-4 and diff["requantized"] > 0.1, diff
