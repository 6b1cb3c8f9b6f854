"""KV-cache compaction after tree verification.

After a speculative step the accepted tree rows sit at scattered cache rows; this moves
them, for every layer and kv head, to the contiguous range [dst_start, dst_start + n):

    cache[l, slot, h, dst_start + i] = cache_old[l, slot, h, src_rows[i]]   for K and V

- dtypes: any float dtype (pure copy, bit-exact); K and V must match.
- head dims: any D (tiled in power-of-two column chunks with a bound mask).
- limits: n <= 256 rows per call; the pool must be contiguous [L, num_slots, H_kv, S, D].
  src_rows need not be sorted or unique (the engine passes ascending accepted rows).
  Out-of-range src rows are only checked when src_rows is on the CPU (checking a device
  tensor would cost a host sync per step); on device such a row is
  masked out (neither read nor written).
- tested under TRITON_INTERPRET=1 on CPU; compiled ahead of time for sm_90 with Triton
  3.6 and 3.9; no GPU timing yet. The interpreter runs programs one at a time and treats
  tl.debug_barrier as a no-op, so the CPU tests cannot show the warp race the barrier
  prevents; they do check order-dependent overlaps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_ROWS = 256
# Rows x columns held in registers per program: 8192 values is 64 per thread at 4 warps.
_TILE_ELEMS = 8192


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
    # 2. Inside a program: it loads ALL n source rows of its slab into registers, then
    #    hits a CTA barrier, then stores. A row that is both a source and a destination
    #    (src=[5,7,8] -> dst=5: row 7 is read and later overwritten by row 8) has been
    #    read by every warp before any warp writes. Without the barrier one warp could
    #    run ahead and store while another warp is still loading the same row.
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

    r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_ok = r < n
    src = tl.load(src_ptr + r, mask=r_ok, other=0)  # [BLOCK_R] int64
    src_ok = r_ok & (src >= 0) & (src < S)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col_ok = cols < D

    rows = tl.load(base + src[:, None] * stride_s + cols[None, :] * stride_d,
                   mask=src_ok[:, None] & col_ok[None, :])  # [BLOCK_R, BLOCK_D]
    tl.debug_barrier()
    dst = dst_start + r  # [BLOCK_R]
    tl.store(base + dst[:, None] * stride_s + cols[None, :] * stride_d, rows,
             mask=src_ok[:, None] & col_ok[None, :])


_INTERPRETED = not isinstance(_kv_compact_kernel, triton.runtime.JITFunction)


def _check_inputs(k_cache, v_cache, slot, src_rows, dst_start, *, for_kernel: bool) -> None:
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
    L, num_slots, H_kv, S, D = k_cache.shape
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < num_slots:
        raise ValueError(f"slot must be an int in [0, {num_slots}), got {slot!r}")
    if src_rows.dtype != torch.int64 or src_rows.dim() != 1:
        raise ValueError(f"src_rows must be a 1-D int64 tensor, got {src_rows.dtype} "
                         f"{tuple(src_rows.shape)}")
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
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("k_cache and v_cache must be contiguous pools")
        if not k_cache.is_cuda and not _INTERPRETED:
            raise RuntimeError("kv_compact needs CUDA tensors (or TRITON_INTERPRET=1 set "
                               "before triton is imported); use kv_compact_ref on CPU")


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
