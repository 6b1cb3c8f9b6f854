"""The target's weights as the engine loads them: a converted HF directory's safetensors, and a GGUF file's Q4_1 and
Q8_0 blocks as stored (``gguf_linear_blocks``), so a quantized target can serve the file's own quantization.

Locating and converting a model source is ``server.model_files``.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file

from server.model_files import WeightsError

class QBlocks(NamedTuple):
    """A GGUF block-quantized matrix as stored, one block per 32 input columns of a row, as unsigned codes:
    W[n, k] = d[n, b] * q[n, k] + m[n, b] with b = k // 32. Q4_1: q in 0..15 as stored (``bits`` 4). Q8_0 (signed
    codes w, W = d * w): q = w + 128 and m = -128 d (``bits`` 8)."""

    q: torch.Tensor  # [N, K] uint8
    d: torch.Tensor  # [N, K / 32] float32 (exact: the file stores float16)
    m: torch.Tensor  # [N, K / 32] float32
    bits: int


Q4_1_BLOCK = 32
# llama.cpp's names of a block's linear layers -> transformers' Llama names
_GGUF_LINEAR = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
Q8_0_BLOCK_BYTES = 2 + Q4_1_BLOCK


def gguf_linear_blocks(gguf: Path) -> dict[str, QBlocks]:
    """The Q4_1 and Q8_0 matrices of a Llama GGUF file (linear layers, the output head and the token embedding, which a
    tied head multiplies by), as stored, under transformers' Llama names.

    Rows come in the order of the converted HF directory: llama.cpp's converter interleaves the rows of q_proj and
    k_proj for its RoPE layout, and transformers' loader undoes that, so the same row permutation is applied here
    (blocks run along a row, so a row permutation keeps them whole). Tensors stored in any other type (float norms)
    are left out, and so is every tensor of an architecture other than ``llama``.
    """
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(gguf)
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        return {}
    n_head, n_kv_head = (_gguf_field(reader, f"llama.attention.{k}") for k in ("head_count", "head_count_kv"))
    out: dict[str, QBlocks] = {}
    kinds = {GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}
    for t in reader.tensors:
        if t.tensor_type not in kinds or len(t.shape) != 2:
            continue
        parts = t.name.split(".")  # blk.<i>.<kind>.weight, output.weight or token_embd.weight
        if t.name == "output.weight":
            name = "lm_head.weight"
        elif t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LINEAR:
            name = f"model.layers.{parts[1]}.{_GGUF_LINEAR[parts[2]]}.weight"
        else:
            continue
        bits = kinds[t.tensor_type]
        q, d, m = (_q4_1_blocks if bits == 4 else _q8_0_blocks)(np.asarray(t.data), int(t.shape[0]))
        # transformers permutes only when both head counts are known (LlamaTensorProcessor); so do we
        if parts[-2] in ("attn_q", "attn_k") and n_head is not None and n_kv_head is not None:
            heads = n_head if parts[-2] == "attn_q" else n_kv_head
            q, d, m = (_unpermute_rope_rows(x, heads) for x in (q, d, m))
        out[name] = QBlocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), bits)
    return out


def gguf_linear_quantization(gguf: Path) -> str | None:
    """What a GGUF file's block linear layers are stored as, read from the tensor types alone: "int4" (every one
    Q4_1), "int8" (every one Q8_0), else None (float, mixed, or not a Llama file)."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(gguf)
    if _gguf_field(reader, "general.architecture") != "llama":
        return None
    kinds = {t.tensor_type for t in reader.tensors
             if t.name.startswith("blk.") and t.name.split(".")[2] in _GGUF_LINEAR}
    return {frozenset({GGMLQuantizationType.Q4_1}): "int4",
            frozenset({GGMLQuantizationType.Q8_0}): "int8"}.get(frozenset(kinds))


def _q4_1_blocks(raw: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw [N, K / 32 * 20] uint8 (per block: float16 d, float16 m, 16 bytes of nibbles) -> q [N, K] uint8,
    d and m [N, K / 32] float32.

    Nibble order as in gguf's own ``Q4_1.dequantize_blocks``: the low nibbles of the 16 bytes are elements 0..15 of
    the block, the high nibbles elements 16..31. In numpy, as the reader hands the file's bytes over."""
    N = raw.shape[0]
    blocks = raw.reshape(N, K // Q4_1_BLOCK, 4 + Q4_1_BLOCK // 2)  # [N, K / 32, 20]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K / 32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]  # [N, K / 32, 16]
    q = np.empty((N, K // Q4_1_BLOCK, Q4_1_BLOCK), dtype=np.uint8)
    np.bitwise_and(nibbles, 0x0F, out=q[..., :Q4_1_BLOCK // 2])
    np.right_shift(nibbles, 4, out=q[..., Q4_1_BLOCK // 2:])
    return q.reshape(N, K), d, m


def _q8_0_blocks(raw: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw [N, K / 32 * 34] uint8 (per block: float16 d, 32 signed int8 codes) -> q = codes + 128 [N, K] uint8,
    d [N, K / 32] float32 and m = -128 d."""
    N = raw.shape[0]
    blocks = raw.reshape(N, K // Q4_1_BLOCK, Q8_0_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q.reshape(N, K), d, -128.0 * d


def _unpermute_rope_rows(x: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q_proj / k_proj (transformers' ``_reverse_permute_weights``)."""
    half = x.shape[0] // n_head // 2
    return np.ascontiguousarray(x.reshape(n_head, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape))


def _gguf_field(reader, key: str):
    """A scalar or string metadata value of a GGUF file, or None when the file lacks it."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def load_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All safetensors shards of a HF directory, merged (names as in transformers' Llama)."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {hf_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
