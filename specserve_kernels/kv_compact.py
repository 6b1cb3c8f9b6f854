"""KV-cache compaction after tree verification.

After a speculative step the accepted tree rows sit at scattered cache rows; this moves
them, for every layer and kv head, to the contiguous range [dst_start, dst_start + n):

    cache[l, slot, h, dst_start + i] = cache_old[l, slot, h, src_rows[i]]   for K and V

kv_compact does it for one sequence (slot); kv_compact_batched for every sequence of a
continuous-batching step in one launch: sequence b moves src_rows[row_starts[b]:row_starts[b + 1]]
within slots[b] to dst_starts[b] (slots, dst_starts, row_starts: device tensors, built once
per step). Its slots must be distinct: each program owns a (sequence, layer, kv head,
K-or-V, column chunk) slab, so the single-sequence race-freedom argument holds per slab.

- dtypes: any float dtype (pure copy, bit-exact); K and V must match.
- head dims: any D (tiled in power-of-two column chunks with a bound mask).
- limits: n <= 256 rows per call (batched: per sequence, or per max_rows if the caller
  gives that tighter bound; rows past it are not moved); the pool must be contiguous
  [L, num_slots, H_kv, S, D]. Batched offsets, slots and destinations are value-checked
  only on the CPU; on the device a destination row past S is skipped.
  src_rows need not be sorted or unique (the engine passes ascending accepted rows).
  Out-of-range src rows are only checked when src_rows is on the CPU (checking a device
  tensor would cost a host sync per step); on device such a row is
  masked out (neither read nor written).
- tested under TRITON_INTERPRET=1 on CPU; compiled ahead of time for sm_90 with Triton
  3.6 and 3.9 (batched kernel: 3.9, no spills); no GPU timing yet. The interpreter runs
  programs one at a time and treats tl.debug_barrier as a no-op, so the CPU tests cannot
  show the warp race the barrier prevents; they do check order-dependent overlaps.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

_MAX_ROWS = 256
# Rows x columns held in registers per program: 8192 values is 64 per thread at 4 warps.
_TILE_ELEMS = 8192


@triton.jit
def _move_rows(base, src_ptr, n, dst_start, S, D, pid_d, stride_s, stride_d,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # One slab (the rows of one layer, kv head, K-or-V and column chunk, at `base`): rows src_ptr[0:n] of it go to
    # dst_start + [0, n). It loads ALL n source rows into registers, then hits a CTA barrier, then stores. A row
    # that is both a source and a destination (src=[5,7,8] -> dst=5: row 7 is read and later overwritten by row 8)
    # has been read by every warp before any warp writes. Without the barrier one warp could run ahead and store
    # while another warp is still loading the same row.
    r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_ok = r < n
    src = tl.load(src_ptr + r, mask=r_ok, other=0)  # [BLOCK_R] int64
    dst = dst_start + r  # [BLOCK_R]
    # dst < S: never write into the next head's rows, even with a bad dst_start on the device.
    ok = r_ok & (src >= 0) & (src < S) & (dst < S)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col_ok = cols < D

    rows = tl.load(base + src[:, None] * stride_s + cols[None, :] * stride_d,
                   mask=ok[:, None] & col_ok[None, :])  # [BLOCK_R, BLOCK_D]
    tl.debug_barrier()
    tl.store(base + dst[:, None] * stride_s + cols[None, :] * stride_d, rows,
             mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _kv_compact_kernel(
    k_ptr, v_ptr, src_ptr,
    n, dst_start, S, H_KV, D,
    stride_l, stride_h, stride_s, stride_d,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Race freedom, by construction:
    # 1. Between programs: a program owns one (layer, kv head, K-or-V, column chunk)
    #    slab. Everything it reads (src rows) and writes (dst rows) lies inside that slab,
    #    and slabs are disjoint, so no program can touch another program's data.
    # 2. Inside a program: all reads, a barrier, then all writes (see _move_rows).
    pid_lh = tl.program_id(0).to(tl.int64)  # int64: offsets into the whole pool can pass 2**31
    which = tl.program_id(1)
    pid_d = tl.program_id(2)
    layer = pid_lh // H_KV
    head = pid_lh % H_KV
    if which == 0:
        base = k_ptr
    else:
        base = v_ptr
    base = base + layer * stride_l + head * stride_h
    _move_rows(base, src_ptr, n, dst_start, S, D, pid_d, stride_s, stride_d, BLOCK_R, BLOCK_D)


@triton.jit
def _kv_compact_batched_kernel(
    k_ptr, v_ptr, src_ptr, slots_ptr, dst_starts_ptr, row_starts_ptr,
    S, H_KV, D,
    stride_l, stride_slot, stride_h, stride_s, stride_d,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Same race-freedom argument as _kv_compact_kernel, with the sequence added to the slab: a program owns one
    # (sequence, layer, kv head, K-or-V, column chunk) slab, all inside that sequence's slot. Sequences of a step
    # hold distinct slots, so slabs stay disjoint.
    pid_lh = tl.program_id(0).to(tl.int64)  # int64: offsets into the whole pool can pass 2**31
    seq = tl.program_id(1) // 2
    which = tl.program_id(1) % 2
    pid_d = tl.program_id(2)
    layer = pid_lh // H_KV
    head = pid_lh % H_KV
    row_start = tl.load(row_starts_ptr + seq)
    n = tl.load(row_starts_ptr + seq + 1) - row_start
    if n <= 0:
        return
    # Rows past BLOCK_R would need a second pass, which could read a row an earlier pass overwrote: the launcher
    # sizes BLOCK_R to the per-sequence cap, and rows past it are not moved.
    n = tl.minimum(n, BLOCK_R)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    dst_start = tl.load(dst_starts_ptr + seq)
    if which == 0:
        base = k_ptr
    else:
        base = v_ptr
    base = base + layer * stride_l + slot * stride_slot + head * stride_h
    _move_rows(base, src_ptr + row_start, n, dst_start, S, D, pid_d, stride_s, stride_d, BLOCK_R, BLOCK_D)


_INTERPRETED = not isinstance(_kv_compact_kernel, triton.runtime.JITFunction)


def _check_pool(k_cache, v_cache, src_rows) -> None:
    if k_cache.dim() != 5:
        raise ValueError(f"expected k_cache [L, num_slots, H_kv, S, D], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} differs from "
                         f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}")
    if not k_cache.dtype.is_floating_point:
        raise TypeError(f"cache dtype must be floating point, got {k_cache.dtype}")
    if v_cache.device != k_cache.device or src_rows.device != k_cache.device:
        raise ValueError(f"device mismatch: k {k_cache.device}, v {v_cache.device}, "
                         f"src_rows {src_rows.device}")
    if src_rows.dtype != torch.int64 or src_rows.dim() != 1:
        raise ValueError(f"src_rows must be a 1-D int64 tensor, got {src_rows.dtype} "
                         f"{tuple(src_rows.shape)}")


def _check_kernel_inputs(k_cache, v_cache, name: str) -> None:
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous pools")
    if not k_cache.is_cuda and not _INTERPRETED:
        raise RuntimeError(f"{name} needs CUDA tensors (or TRITON_INTERPRET=1 set "
                           f"before triton is imported); use {name}_ref on CPU")


def _check_inputs(k_cache, v_cache, slot, src_rows, dst_start, *, for_kernel: bool) -> None:
    _check_pool(k_cache, v_cache, src_rows)
    L, num_slots, H_kv, S, D = k_cache.shape
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < num_slots:
        raise ValueError(f"slot must be an int in [0, {num_slots}), got {slot!r}")
    n = src_rows.shape[0]
    if n > _MAX_ROWS:
        raise ValueError(f"at most {_MAX_ROWS} rows per call, got {n}")
    if isinstance(dst_start, bool) or not isinstance(dst_start, int) or dst_start < 0 \
            or dst_start + n > S:
        raise ValueError(f"destination rows [{dst_start}, {dst_start} + {n}) outside [0, {S})")
    if src_rows.device.type == "cpu" and n > 0:
        lo, hi = int(src_rows.min()), int(src_rows.max())
        if lo < 0 or hi >= S:
            raise ValueError(f"src_rows must lie in [0, {S}), got min {lo} max {hi}")
    if for_kernel:
        _check_kernel_inputs(k_cache, v_cache, "kv_compact")


def kv_compact(k_cache, v_cache, slot: int, src_rows, dst_start: int) -> None:
    """In place: move rows src_rows to [dst_start, dst_start + n) of `slot`, all layers/heads, K and V."""
    _check_inputs(k_cache, v_cache, slot, src_rows, dst_start, for_kernel=True)
    L, _, H_kv, S, D = k_cache.shape
    n = src_rows.shape[0]
    if n == 0 or L == 0 or H_kv == 0 or D == 0:
        return
    block_r = max(16, triton.next_power_of_2(n))
    block_d = min(triton.next_power_of_2(D), max(16, _TILE_ELEMS // block_r))
    # Views at the slot: the kernel never needs the slot stride, only the data pointer.
    k_slot = k_cache.select(1, slot)  # [L, H_kv, S, D]
    v_slot = v_cache.select(1, slot)  # [L, H_kv, S, D]
    grid = (L * H_kv, 2, triton.cdiv(D, block_d))
    _kv_compact_kernel[grid](
        k_slot, v_slot, src_rows,
        n, dst_start, S, H_kv, D,
        k_slot.stride(0), k_slot.stride(1), k_slot.stride(2), k_slot.stride(3),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=4,
    )


def kv_compact_ref(k_cache, v_cache, slot: int, src_rows, dst_start: int) -> None:
    """Plain-torch reference: gather every source row into scratch first, then write."""
    _check_inputs(k_cache, v_cache, slot, src_rows, dst_start, for_kernel=False)
    n = src_rows.shape[0]
    for cache in (k_cache, v_cache):
        rows = cache[:, slot]  # [L, H_kv, S, D] view
        # index_select copies, so overlapping source rows are read before any write.
        scratch = rows.index_select(2, src_rows)  # [L, H_kv, n, D]
        rows[:, :, dst_start:dst_start + n] = scratch


def _check_batched_inputs(k_cache, v_cache, slots, src_rows, dst_starts, row_starts, max_rows, *,
                          for_kernel: bool) -> None:
    _check_pool(k_cache, v_cache, src_rows)
    num_slots, S = k_cache.shape[1], k_cache.shape[3]
    if not isinstance(row_starts, torch.Tensor) or row_starts.dim() != 1 or row_starts.shape[0] < 1:
        raise ValueError("row_starts must be a 1-D tensor of B + 1 row offsets")
    B = row_starts.shape[0] - 1
    for name, t, n in (("slots", slots, B), ("dst_starts", dst_starts, B), ("row_starts", row_starts, B + 1)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.shape != (n,):
            raise ValueError(f"{name} must be an int32/int64 tensor of shape [{n}], got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} on {t.device}, k_cache on {k_cache.device}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int)
                                 or not 1 <= max_rows <= _MAX_ROWS):
        raise ValueError(f"max_rows must be an int in [1, {_MAX_ROWS}], got {max_rows!r}")
    cap = _MAX_ROWS if max_rows is None else max_rows
    # Values are only checked on the CPU: reading device tensors back would cost a host sync per step.
    if k_cache.device.type == "cpu":
        starts, slot_list, dsts = row_starts.tolist(), slots.tolist(), dst_starts.tolist()
        N = src_rows.shape[0]
        if starts[0] != 0 or starts[-1] != N or any(a > b for a, b in itertools.pairwise(starts)):
            raise ValueError(f"row_starts must rise from 0 to len(src_rows)={N}, got {starts}")
        if any(not 0 <= s < num_slots for s in slot_list) or len(set(slot_list)) != B:
            raise ValueError(f"slots must be distinct and in [0, {num_slots}), got {slot_list}")
        for b in range(B):
            n = starts[b + 1] - starts[b]
            if n > cap:
                raise ValueError(f"sequence {b}: {n} rows, at most {cap} per sequence")
            if dsts[b] < 0 or dsts[b] + n > S:
                raise ValueError(f"sequence {b}: destination rows [{dsts[b]}, {dsts[b]} + {n}) outside [0, {S})")
        if N > 0 and (int(src_rows.min()) < 0 or int(src_rows.max()) >= S):
            raise ValueError(f"src_rows must lie in [0, {S}), got min {int(src_rows.min())} "
                             f"max {int(src_rows.max())}")
    if for_kernel:
        _check_kernel_inputs(k_cache, v_cache, "kv_compact_batched")


def kv_compact_batched(k_cache, v_cache, slots, src_rows, dst_starts, row_starts, max_rows: int | None = None) -> None:
    """In place, one launch for a whole step: for each sequence b, move its accepted rows
    src_rows[row_starts[b]:row_starts[b + 1]] (absolute rows of slot slots[b]) to [dst_starts[b], dst_starts[b] + n_b),
    all layers/heads, K and V.

    slots [B], dst_starts [B], row_starts [B + 1]: int32/int64 on the pool's device; src_rows [N] int64. Slots must
    be distinct. max_rows: an upper bound on any n_b that the caller knows (e.g. the deepest accepted path); it
    only sizes the register tile, and defaults to min(N, 256). Rows of a sequence past it are not moved.
    """
    _check_batched_inputs(k_cache, v_cache, slots, src_rows, dst_starts, row_starts, max_rows, for_kernel=True)
    L, _, H_kv, S, D = k_cache.shape
    N, B = src_rows.shape[0], row_starts.shape[0] - 1
    if N == 0 or B == 0 or L == 0 or H_kv == 0 or D == 0:
        return
    # Every n_b <= N, so min(N, cap) bounds them all without reading row_starts back.
    block_r = max(16, triton.next_power_of_2(min(N, _MAX_ROWS if max_rows is None else max_rows)))
    block_d = min(triton.next_power_of_2(D), max(16, _TILE_ELEMS // block_r))
    grid = (L * H_kv, 2 * B, triton.cdiv(D, block_d))
    _kv_compact_batched_kernel[grid](
        k_cache, v_cache, src_rows, slots, dst_starts, row_starts,
        S, H_kv, D,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3), k_cache.stride(4),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=4,
    )


def kv_compact_batched_ref(k_cache, v_cache, slots, src_rows, dst_starts, row_starts,
                           max_rows: int | None = None) -> None:
    """Plain-torch reference for kv_compact_batched: kv_compact_ref once per sequence (slots are distinct, so order
    does not matter)."""
    _check_batched_inputs(k_cache, v_cache, slots, src_rows, dst_starts, row_starts, max_rows, for_kernel=False)
    starts, slot_list, dsts = row_starts.tolist(), slots.tolist(), dst_starts.tolist()
    for b, (slot, dst) in enumerate(zip(slot_list, dsts)):
        if starts[b + 1] > starts[b]:
            kv_compact_ref(k_cache, v_cache, slot, src_rows[starts[b]:starts[b + 1]], dst)
