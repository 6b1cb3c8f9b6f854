"""Tree attention for speculative-decoding verification (and causal prefill).

Computes softmax(q k^T * scale) v for the T new rows of a sequence in ONE layer:
every new row sees the whole verified prefix cache[0:cache_len], plus the new rows
that the tree mask marks visible (its ancestors and itself). With tree_mask=None the
new rows are causal among themselves, which is what prefill (T in the thousands) needs.

- tree_attention: one sequence, k/v_cache [H_kv, S, D] (its slot of one layer).
- tree_attention_batched: the rows of B sequences back to back (q [T_total, H, D]) in one
  launch, for one continuous-batching forward. k/v are one layer of the whole pool,
  [num_slots, H_kv, S, D]; per sequence b, on the device: slots[b], cache_lens[b],
  row_starts[b] (B + 1 offsets) and causal[b] (prefill chunk: causal rows, any count;
  else a draft tree: per-row int64 ancestor bits relative to its own first row). The
  grid is (row blocks of every sequence, kv heads); a row block never spans two
  sequences, and a program finds its sequence from row_starts, so the launch needs no
  host sync. A sequence's rows get the same arithmetic as in tree_attention (float32:
  the same bits; 16-bit: tiles sized per batch, so equal to a few ulps).

- dtypes: float16 / bfloat16 / float32 in, same dtype out; scores, softmax and the
  output accumulator are float32 (P is rounded to the input dtype for the P@V dot,
  as in flash attention).
- head dims: any power of two in [16, 256] (models here use 64 and 128).
- GQA: H % H_kv == 0, query head h reads kv head h // (H // H_kv).
- limits: with a tree mask T <= 64 per sequence (one int64 word of ancestor bits per row,
  bit 63 is the sign bit). No split-K over the prefix yet, so a decode step with few kv
  heads launches few programs and long prefixes are latency-bound on a big GPU (batching
  B sequences multiplies the programs by B). Batched inputs are checked for values
  (offsets, slots, cache bounds, tree sizes) only on the CPU: reading device tensors back
  would cost a host sync per layer. Each program scans all B row offsets (B <= a few
  hundred is cheap).
- sliding window (the local layers of Gemma 3, Mistral v0.1, windowed Qwen): ``window`` W and ``positions``, the
  new rows' positions ([T], a tree row's is cache_len + its depth); prefix row n is at position n, and a row at
  position p sees only keys at positions > p - W. The prefix tiles wholly before a row block's window are skipped.
- a row that sees no key at all (cache_len == 0 and a mask without its self bit)
  gets zeros; the reference gives NaN there.
- float32 inputs use exact ("ieee") dots on small tiles: correct but slow, for tests.
- tested under TRITON_INTERPRET=1 on CPU (float32 and float16 only: the interpreter's
  tl.dot multiplies bfloat16 as raw uint16 bits); compiled ahead of time for sm_90 with
  Triton 3.6 and 3.9 (no register spills for 16-bit inputs; the batched kernel: Triton
  3.9 only, no spills for any dtype, D 64..256, within 25 registers of the single one);
  no GPU timing yet.

This module holds the two launchers. The Triton kernels are in specserve_kernels.tree_attention_kernels, the input checks in
specserve_kernels.tree_attention_checks, the plain-torch references in specserve_kernels.tree_attention_reference and the masks
(ancestor_bitmask, tree_mask_to_bool) in specserve_kernels.tree_mask.
"""

from __future__ import annotations

import math

import torch
import triton

from .tree_attention_checks import _check_batched_inputs, _check_inputs, _check_window
from .tree_attention_kernels import _tree_attention_batched_kernel, _tree_attention_kernel


def _tile_config(dtype: torch.dtype, D: int, packed_rows: int) -> tuple[str, int, int, int]:
    """(dot precision, BLOCK_M, BLOCK_N, num_warps) for ~packed_rows (new row, head-in-group) rows per sequence."""
    if dtype == torch.float32:
        # "ieee" keeps float32 exact (TF32 tensor cores would give ~1e-3 relative error),
        # but it lowers to FMA loops: sm_90 builds of larger tiles spill registers.
        return "ieee", 16, 32, 8
    block_m = 64 if packed_rows > 32 else max(16, triton.next_power_of_2(packed_rows))
    block_n = 64 if D <= 128 else 32  # a 256-wide head's K/V tiles must stay in registers
    num_warps = 4 if D <= 64 else 8
    return "tf32", block_m, block_n, num_warps  # precision is ignored for 16-bit inputs


def tree_attention(q, k_cache, v_cache, cache_len: int, tree_mask, scale: float | None = None,
                   window: int | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Triton tree/causal attention; see the module docstring. Returns [T, H, D] in q.dtype."""
    _check_inputs(q, k_cache, v_cache, cache_len, tree_mask, for_kernel=True)
    _check_window(q, window, positions)
    T, H, D = q.shape
    H_kv = k_cache.shape[0]
    group = H // H_kv
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)  # [T, H, D]
    if T == 0:
        return out
    if scale is None:
        scale = 1.0 / math.sqrt(D)

    packed_rows = T * group
    precision, block_m, block_n, num_warps = _tile_config(q.dtype, D, packed_rows)
    # Never dereferenced when HAS_MASK is False; any tensor on the device will do.
    mask_arg = tree_mask if tree_mask is not None else q
    pos_arg = positions if window is not None else q

    grid = (triton.cdiv(packed_rows, block_m), H_kv)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out, mask_arg, pos_arg,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        cache_len, T, group, float(scale) * math.log2(math.e), int(window or 0),
        HAS_MASK=tree_mask is not None,
        HAS_WINDOW=window is not None,
        HEAD_DIM=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        num_warps=num_warps,
    )
    return out


def tree_attention_batched(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal,
                           scale: float | None = None, window: int | None = None,
                           positions: torch.Tensor | None = None) -> torch.Tensor:
    """Tree/causal attention for the rows of B sequences, one layer, one launch. Returns [T_total, H, D].

    q [T_total, H, D]: every sequence's new rows back to back. k_layer, v_layer [num_slots, H_kv, S, D]: one
    layer of the KV pool (e.g. ``pool_k[layer]``), new rows already written at cache_len + j of their slot.
    slots [B], cache_lens [B], row_starts [B + 1] (int32/int64, on q's device): sequence b owns rows
    row_starts[b]:row_starts[b + 1] and KV slot slots[b], whose first cache_lens[b] rows are its verified prefix.
    tree_mask [T_total] int64: ancestor bits of each row relative to its sequence's first row (ignored where
    causal[b]); causal [B] bool/int: that sequence's rows are causal among themselves (prefill chunk, any count).
    tree_mask=None means every sequence is causal (causal may then be None; it is not read).
    window, positions [T_total]: a sliding-window layer (see the module docstring), each row's position.
    Build these once per forward and share them across layers; see the module docstring for limits.
    """
    _check_batched_inputs(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal, for_kernel=True)
    _check_window(q, window, positions)
    T_total, H, D = q.shape
    H_kv = k_layer.shape[1]
    B = row_starts.shape[0] - 1
    group = H // H_kv
    out = torch.empty((T_total, H, D), dtype=q.dtype, device=q.device)  # [T_total, H, D]
    if T_total == 0 or B == 0:
        return out
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    # A row block never spans two sequences, so size it for the average sequence (per-sequence counts would need a
    # host sync): decode-heavy batches get 16-row tiles, prefill chunks 64-row ones.
    precision, block_m, block_n, num_warps = _tile_config(q.dtype, D, triton.cdiv(T_total * group, B))
    has_tree = tree_mask is not None
    # Never dereferenced when HAS_TREE is False; any tensor on the device will do.
    mask_arg = tree_mask if has_tree else q
    causal_arg = causal if has_tree else q
    pos_arg = positions if window is not None else q

    grid = (T_total * group // block_m + B, H_kv)
    _tree_attention_batched_kernel[grid](
        q, k_layer, v_layer, out, mask_arg, pos_arg,
        slots, cache_lens, row_starts, causal_arg,
        q.stride(0), q.stride(1), q.stride(2),
        k_layer.stride(0), k_layer.stride(1), k_layer.stride(2), k_layer.stride(3),
        v_layer.stride(0), v_layer.stride(1), v_layer.stride(2), v_layer.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        B, group, float(scale) * math.log2(math.e), int(window or 0),
        HAS_TREE=has_tree,
        HAS_WINDOW=window is not None,
        BLOCK_B=max(16, triton.next_power_of_2(B)),
        HEAD_DIM=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        num_warps=num_warps,
    )
    return out
