"""Input checks of tree attention, shared by the Triton launchers (specserve_kernels.tree_attention) and the plain-torch
references (specserve_kernels.tree_attention_reference): ranks, dtypes, devices, head dims and the GQA ratio; the cache bounds
and the tree mask of one sequence; for the batched call the per-sequence slots, cache lengths, row offsets and causal
flags (their values are checked only on the CPU: reading device tensors back would cost a host sync per layer).
"""

from __future__ import annotations

import itertools

import torch

from .tree_attention_kernels import _INTERPRETED
from .tree_mask import _MAX_TREE_ROWS


def _check_qkv(q, k_cache, v_cache, kv_dims: int, kv_layout: str) -> None:
    """Checks shared by both launchers: ranks, dtypes, devices, head dims, GQA ratio."""
    if q.dim() != 3 or k_cache.dim() != kv_dims or v_cache.dim() != kv_dims:
        raise ValueError(f"expected q [T, H, D] and k/v {kv_layout}, got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q dtype must be float16/bfloat16/float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"device mismatch: q {q.device}, k {k_cache.device}, v {v_cache.device}")
    H, D = q.shape[1:]
    H_kv, Dk = k_cache.shape[-3], k_cache.shape[-1]
    if Dk != D:
        raise ValueError(f"head dim mismatch: q {D}, cache {Dk}")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {H_kv}")


def _check_tree_mask(tree_mask, q, rows: str, n: int) -> None:
    """The mask: int64, one entry per query row (``rows`` = ``n`` of them), on q's device."""
    if tree_mask.dtype != torch.int64 or tree_mask.shape != (n,):
        raise ValueError(f"tree_mask must be int64 [{rows}={n}], got {tree_mask.dtype} {tuple(tree_mask.shape)}")
    if tree_mask.device != q.device:
        raise ValueError(f"tree_mask on {tree_mask.device}, q on {q.device}")


def _check_window(q, window, positions) -> None:
    """A sliding window: a positive int, with an int32/int64 position per query row on q's device."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    if (not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64)
            or positions.shape != (q.shape[0],) or positions.device != q.device):
        raise ValueError(f"a window needs positions, an int tensor of shape [{q.shape[0]}] on {q.device}, got "
                         f"{getattr(positions, 'dtype', type(positions))} {tuple(getattr(positions, 'shape', ()))}")


def _check_kernel_inputs(q, name: str) -> None:
    D = q.shape[-1]
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"head dim must be a power of two in [16, 256], got {D}")
    if not q.is_cuda and not _INTERPRETED:
        raise RuntimeError(f"{name} needs CUDA tensors (or TRITON_INTERPRET=1 set "
                           f"before triton is imported); use {name}_ref on CPU")


def _check_inputs(q, k_cache, v_cache, cache_len, tree_mask, *, for_kernel: bool) -> None:
    _check_qkv(q, k_cache, v_cache, 3, "[H_kv, S, D]")
    T = q.shape[0]
    S = k_cache.shape[1]
    if isinstance(cache_len, bool) or not isinstance(cache_len, int) or cache_len < 0:
        raise ValueError(f"cache_len must be an int >= 0, got {cache_len!r}")
    if S < cache_len + T:
        raise ValueError(f"cache has {S} rows, need cache_len + T = {cache_len + T}")
    if tree_mask is not None:
        _check_tree_mask(tree_mask, q, "T", T)
        if T > _MAX_TREE_ROWS:
            raise ValueError(f"a tree mask supports at most {_MAX_TREE_ROWS} rows, got T={T}; "
                             f"use tree_mask=None (causal) for prefill")
    if for_kernel:
        _check_kernel_inputs(q, "tree_attention")


def _check_batched_inputs(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal, *,
                          for_kernel: bool) -> None:
    _check_qkv(q, k_layer, v_layer, 4, "[num_slots, H_kv, S, D]")
    T_total = q.shape[0]
    num_slots, S = k_layer.shape[0], k_layer.shape[2]
    if not isinstance(row_starts, torch.Tensor) or row_starts.dim() != 1 or row_starts.shape[0] < 1:
        raise ValueError("row_starts must be a 1-D tensor of B + 1 row offsets")
    B = row_starts.shape[0] - 1
    per_seq = {"slots": slots, "cache_lens": cache_lens, "row_starts": row_starts}
    if tree_mask is not None or causal is not None:
        per_seq["causal"] = causal
    for name, t in per_seq.items():
        n = B + 1 if name == "row_starts" else B
        allowed = (torch.int32, torch.int64) + ((torch.bool,) if name == "causal" else ())
        if not isinstance(t, torch.Tensor) or t.dtype not in allowed or t.shape != (n,):
            raise ValueError(f"{name} must be a {' or '.join(map(str, allowed))} tensor of shape [{n}], got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        if t.device != q.device:
            raise ValueError(f"{name} on {t.device}, q on {q.device}")
    if tree_mask is not None:
        _check_tree_mask(tree_mask, q, "T_total", T_total)
    # Values are only checked on the CPU: reading device tensors back would cost a host sync per layer.
    if q.device.type == "cpu":
        starts, lens, slot_list = row_starts.tolist(), cache_lens.tolist(), slots.tolist()
        flags = [True] * B if causal is None else [bool(c) for c in causal.tolist()]
        if tree_mask is None and not all(flags):
            raise ValueError(f"causal = {flags} marks tree sequences but tree_mask is None")
        if starts[0] != 0 or starts[-1] != T_total or any(a > b for a, b in itertools.pairwise(starts)):
            raise ValueError(f"row_starts must rise from 0 to T_total={T_total}, got {starts}")
        for b in range(B):
            n = starts[b + 1] - starts[b]
            if not 0 <= slot_list[b] < num_slots:
                raise ValueError(f"slots[{b}] = {slot_list[b]} outside [0, {num_slots})")
            if lens[b] < 0 or lens[b] + n > S:
                raise ValueError(f"sequence {b}: cache_len {lens[b]} + {n} rows outside a slot of {S} rows")
            if not flags[b] and n > _MAX_TREE_ROWS:
                raise ValueError(f"sequence {b}: a tree mask supports at most {_MAX_TREE_ROWS} rows, got {n}; "
                                 f"mark it causal for prefill")
    if for_kernel:
        _check_kernel_inputs(q, "tree_attention_batched")
