"""The target's weights as the engine loads them (``load_weights``): a HF directory's safetensors or a GGUF file's
tensors de-quantized (``server.gguf_file``), and a GGUF file's affine blocks as stored (``gguf_linear_blocks``), so a
quantized target can serve the file's own quantization.

Locating a model source is ``server.model_files``.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file

from server.gguf_file import ARCHITECTURES, GGUFFile, open_gguf, unpermute_rope_rows
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
Q8_0_BLOCK_BYTES = 2 + Q4_1_BLOCK
LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # llama.cpp's names


def gguf_linear_blocks(gguf: GGUFFile | Path) -> dict[str, QBlocks]:
    """The block-quantized matrices of a GGUF file whose blocks of 32 are affine (linear layers, the output head and
    the token embedding, which a tied head multiplies by), as stored, under transformers' names: Q4_0, Q4_1 and Q4_K
    as 4-bit codes; Q5_0, Q5_K and Q8_0 as 8-bit codes (``QBlocks``). A K-quant super-block of 256 is 8 sub-blocks
    of 32, each d * sc * q - dmin * m: an affine block of 32. Q6_K (sub-blocks of 16) and every other type are left
    out, and so is every tensor of an architecture ``server.gguf_file`` does not read.

    Rows come in transformers' order: llama.cpp's "llama" converter interleaves the rows of q_proj and k_proj for its
    RoPE layout, undone as for the de-quantized weights (blocks run along a row, so a row permutation keeps them
    whole).
    """
    gguf = open_gguf(gguf)
    out: dict[str, QBlocks] = {}
    for t in gguf.tensors:
        unpack = _UNPACK.get(t.type)
        name = gguf.hf_name(t)
        if unpack is None or len(t.shape) != 2 or name is None or not name.endswith(".weight"):
            continue
        if not (t.name in ("output.weight", "token_embd.weight") or t.name.split(".")[2] in LINEAR_KINDS):
            continue
        bits, fn = unpack
        raw = gguf.raw(t)
        q, d, m = fn(np.asarray(raw), raw.shape[1] // _BYTES_PER_32[t.type] * Q4_1_BLOCK)
        heads = gguf.rope_row_heads(t)
        if heads is not None:
            q, d, m = (unpermute_rope_rows(x, heads) for x in (q, d, m))
        out[name] = QBlocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), bits)
    return out


def gguf_linear_quantization(gguf: GGUFFile | Path) -> str | None:
    """What a GGUF file's block linear layers are stored as, read from the tensor types alone: "int4" (every one
    4-bit affine blocks: Q4_0, Q4_1 or Q4_K), "int8" (every one Q8_0), else None (float, mixed widths such as
    Q4_K_M's, or an architecture ``server.gguf_file`` does not read)."""
    gguf = open_gguf(gguf)
    if gguf.architecture not in ARCHITECTURES:
        return None
    kinds = {t.type for t in gguf.tensors if t.name.startswith("blk.") and t.name.split(".")[2] in LINEAR_KINDS}
    if kinds and kinds <= {"Q4_0", "Q4_1", "Q4_K"}:
        return "int4"
    return "int8" if kinds == {"Q8_0"} else None


def load_weights(hf_dir: Path, gguf: GGUFFile | None = None,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The target's weights under transformers' names: a GGUF file's, de-quantized one tensor at a time into
    ``dtype``; else the directory's safetensors (as stored: the caller casts)."""
    if gguf is not None:
        return dict(gguf.state_dict(dtype))
    return load_state_dict(hf_dir)


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (exact: the file stores float16)."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """[..., n] uint8 -> [..., 2 n]: the n bytes' low nibbles, then their high nibbles (ggml's order: a Q4_0 / Q4_1
    block's 16 bytes, a K-quant's 32-byte pair of sub-blocks)."""
    lo, hi = raw & 0x0F, raw >> 4
    return np.concatenate([lo[..., None, :], hi[..., None, :]], axis=-2).reshape(*raw.shape[:-1], -1)


def _q4_1_blocks(raw: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw [N, K / 32 * 20] uint8 (per block: float16 d, float16 m, 16 bytes of nibbles) -> q [N, K] uint8,
    d and m [N, K / 32] float32.

    Nibble order as in gguf's own ``Q4_1.dequantize_blocks``: the low nibbles of the 16 bytes are elements 0..15 of
    the block, the high nibbles elements 16..31. In numpy, as the reader hands the file's bytes over."""
    N = raw.shape[0]
    blocks = raw.reshape(N, K // Q4_1_BLOCK, 4 + Q4_1_BLOCK // 2)  # [N, K / 32, 20]
    return _nibbles(blocks[..., 4:]).reshape(N, K), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])


def _q8_0_blocks(raw: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw [N, K / 32 * 34] uint8 (per block: float16 d, 32 signed int8 codes) -> q = codes + 128 [N, K] uint8,
    d [N, K / 32] float32 and m = -128 d."""
    N = raw.shape[0]
    blocks = raw.reshape(N, K // Q4_1_BLOCK, Q8_0_BLOCK_BYTES)
    d = _f16(blocks[..., 0:2])
    q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q.reshape(N, K), d, -128.0 * d


def _q4_0_blocks(raw: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0: per block float16 d, 16 bytes of nibbles; W = d * (q - 8) -> q in 0..15, d, m = -8 d."""
    N = raw.shape[0]
    blocks = raw.reshape(N, K // Q4_1_BLOCK, 18)
    d = _f16(blocks[..., 0:2])
    return _nibbles(blocks[..., 2:]).reshape(N, K), d, -8.0 * d


def _q5_0_blocks(raw: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_0: per block float16 d, 4 bytes of fifth bits (bit i: element i), 16 bytes of nibbles; W = d * (q - 16) ->
    q in 0..31 (as 8-bit codes), d, m = -16 d."""
    N = raw.shape[0]
    blocks = raw.reshape(N, K // Q4_1_BLOCK, 22)
    d = _f16(blocks[..., 0:2])
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [N, K / 32, 32]
    return (_nibbles(blocks[..., 6:]) | (high << 4)).reshape(N, K), d, -16.0 * d


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's 12 bytes -> its 8 sub-blocks' 6-bit scales and mins (ggml's get_scale_min_k4)."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_affine(blocks: np.ndarray, q: np.ndarray, N: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: float16 d and dmin, then the scales; sub-block j is W = (d * sc_j) * q - dmin * m_j ->
    (q [N, K], d * sc [N, K / 32], -dmin * m [N, K / 32]), the products in float32 as ggml forms them."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [N, K / 256]
    sc, mn = _k_scales(blocks[..., 4:16])  # [N, K / 256, 8]
    scale = (d[..., None] * sc.astype(np.float32)).reshape(N, K // Q4_1_BLOCK)
    low = -(dmin[..., None] * mn.astype(np.float32)).reshape(N, K // Q4_1_BLOCK)
    return q.reshape(N, K), scale, low


def _q4_k_blocks(raw: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K: super-blocks of 256 (144 bytes): d, dmin, 12 bytes of scales, 128 bytes of nibbles (each 32 bytes: two
    sub-blocks, low nibbles then high)."""
    N = raw.shape[0]
    blocks = raw.reshape(N, K // 256, 144)
    return _k_affine(blocks, _nibbles(blocks[..., 16:].reshape(N, K // 256, 4, 32)), N, K)


def _q5_k_blocks(raw: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K: super-blocks of 256 (176 bytes): d, dmin, 12 bytes of scales, 32 bytes of fifth bits (bit j of byte i:
    element i of sub-block j), then the nibbles as Q4_K's; q in 0..31 (as 8-bit codes)."""
    N = raw.shape[0]
    blocks = raw.reshape(N, K // 256, 176)
    low = _nibbles(blocks[..., 48:].reshape(N, K // 256, 4, 32)).reshape(N, K // 256, 8, 32)
    qh = blocks[..., 16:48]  # [N, K / 256, 32]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, K / 256, 8, 32]
    return _k_affine(blocks, low | (high << 4), N, K)


# GGML type name -> (code bits of QBlocks, unpacker (raw [N, bytes] uint8, K) -> (q, d, m))
_UNPACK = {"Q4_0": (4, _q4_0_blocks), "Q4_1": (4, _q4_1_blocks), "Q4_K": (4, _q4_k_blocks),
           "Q5_0": (8, _q5_0_blocks), "Q5_K": (8, _q5_k_blocks), "Q8_0": (8, _q8_0_blocks)}
# bytes a row spends on 32 of its columns, per type
_BYTES_PER_32 = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144 // 8, "Q5_0": 22, "Q5_K": 176 // 8, "Q8_0": Q8_0_BLOCK_BYTES}


def load_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All safetensors shards of a HF directory, merged (names as in transformers' Llama)."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {hf_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
