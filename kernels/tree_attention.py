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
- a row that sees no key at all (cache_len == 0 and a mask without its self bit)
  gets zeros; the reference gives NaN there.
- float32 inputs use exact ("ieee") dots on small tiles: correct but slow, for tests.
- tested under TRITON_INTERPRET=1 on CPU (float32 and float16 only: the interpreter's
  tl.dot multiplies bfloat16 as raw uint16 bits); compiled ahead of time for sm_90 with
  Triton 3.6 and 3.9 (no register spills for 16-bit inputs; the batched kernel: Triton
  3.9 only, no spills for any dtype, D 64..256, within 25 registers of the single one);
  no GPU timing yet.
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl

_MAX_TREE_ROWS = 64


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    # s is in log2 units (scale * log2(e) folded in), so exp2 gives the usual softmax.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_block(
    q_ptr, k_base, v_base, o_ptr, mask_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kd,
    stride_vs, stride_vd,
    stride_ot, stride_oh, stride_od,
    cache_len, T, m_start, kvh, GROUP, qk_scale, is_tree,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One row block of ONE sequence: q_ptr, o_ptr and mask_ptr point at the sequence's first new row, k_base and
    # v_base at its (slot, kv head) rows. The M dimension packs (new row, query head in the GQA group) pairs,
    # t-major, starting at packed row m_start. Why: a decode/verify step has T in 1..64, far below a 16-row dot
    # tile; packing the group fills the tile (T=1, G=8 -> 8 useful rows instead of 1) and every K/V tile is loaded
    # once per group instead of G times. is_tree: rows use the ancestor bits at mask_ptr, else causal new rows.
    rows = m_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] packed t * GROUP + g
    row_ok = rows < T * GROUP
    t = rows // GROUP  # [BLOCK_M] new-row index
    head = kvh * GROUP + rows % GROUP  # [BLOCK_M] query head
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(
        q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None], other=0.0,
    )  # [BLOCK_M, D]

    # Finite start value: a row whose first tiles are fully masked would otherwise
    # compute exp2(-inf - -inf) = NaN in the rescale factor.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # [BLOCK_M, D]

    # Verified prefix: visible to every row, so only the tail tile needs a bound mask.
    for start in range(0, cache_len, BLOCK_N):
        n = start + offs_n  # [BLOCK_N] absolute cache row
        n_ok = n < cache_len
        k = tl.load(k_base + n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                    mask=n_ok[None, :], other=0.0)  # [D, BLOCK_N]
        v = tl.load(v_base + n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None], other=0.0)  # [BLOCK_N, D]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    if is_tree:
        row_bits = tl.load(mask_ptr + t, mask=row_ok, other=0)  # [BLOCK_M] int64
        n_end = T
    else:
        row_bits = tl.zeros([BLOCK_M], dtype=tl.int64)  # unused
        # Causal: no row of this block sees a new row past its own last t.
        n_end = tl.minimum(T, (m_start + BLOCK_M - 1) // GROUP + 1)

    # New rows (tree or prompt): live at cache rows cache_len + j.
    for start in range(0, n_end, BLOCK_N):
        j = start + offs_n  # [BLOCK_N] new-row index
        j_ok = j < T
        n = cache_len + j
        k = tl.load(k_base + n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                    mask=j_ok[None, :], other=0.0)  # [D, BLOCK_N]
        v = tl.load(v_base + n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=j_ok[:, None], other=0.0)  # [BLOCK_N, D]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if is_tree:
            # Arithmetic shift sign-extends bit 63, but `& 1` still reads it correctly.
            # Clamp keeps the shift amount defined for padding columns j >= 64.
            shift = tl.minimum(j, 63).to(tl.int64)
            visible = ((row_bits[:, None] >> shift[None, :]) & 1) != 0
        else:
            visible = j[None, :] <= t[:, None]
        visible = visible & j_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    # l_i == 0 only for padding rows, or a row that sees nothing at all (cache_len == 0
    # and a mask without its self bit); write 0 there instead of NaN.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        o_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None],
    )


# cache_len and T change every step; without do_not_specialize Triton would compile
# separate variants for values equal to 1 or divisible by 16.
@triton.jit(do_not_specialize=["cache_len", "T"])
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kh, stride_ks, stride_kd,
    stride_vh, stride_vs, stride_vd,
    stride_ot, stride_oh, stride_od,
    cache_len, T, GROUP, qk_scale,
    HAS_MASK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grid is (row blocks, kv heads) of the one sequence.
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    _attend_block(
        q_ptr, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, o_ptr, mask_ptr,
        stride_qt, stride_qh, stride_qd, stride_ks, stride_kd, stride_vs, stride_vd,
        stride_ot, stride_oh, stride_od,
        cache_len, T, pid_m * BLOCK_M, kvh, GROUP, qk_scale, HAS_MASK,
        HEAD_DIM, BLOCK_M, BLOCK_N, DOT_PRECISION,
    )


# B changes every step (see _tree_attention_kernel on do_not_specialize).
@triton.jit(do_not_specialize=["B"])
def _tree_attention_batched_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr,
    slots_ptr, cache_lens_ptr, row_starts_ptr, causal_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kslot, stride_kh, stride_ks, stride_kd,
    stride_vslot, stride_vh, stride_vs, stride_vd,
    stride_ot, stride_oh, stride_od,
    B, GROUP, qk_scale,
    HAS_TREE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grid is (row blocks of all sequences, kv heads). Sequence b owns the flat blocks from
    # first[b] = row_starts[b] * GROUP // BLOCK_M + b on, which is at least cdiv(n_b * GROUP, BLOCK_M) of them
    # (the + b pays for each sequence's partial last block), so the grid is T_total * GROUP // BLOCK_M + B blocks,
    # known on the host without reading row_starts back. A program finds its sequence by counting the firsts <= its
    # block (firsts strictly increase); blocks past a sequence's rows return at once.
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    bs = tl.arange(0, BLOCK_B)  # [BLOCK_B]
    b_ok = bs < B
    starts = tl.load(row_starts_ptr + bs, mask=b_ok, other=0).to(tl.int32)  # [BLOCK_B]
    first = starts * GROUP // BLOCK_M + bs  # [BLOCK_B]
    seq = tl.sum(((first <= pid) & b_ok).to(tl.int32), 0) - 1

    row_start = tl.load(row_starts_ptr + seq).to(tl.int32)
    T = tl.load(row_starts_ptr + seq + 1).to(tl.int32) - row_start
    m_start = (pid - (row_start * GROUP // BLOCK_M + seq)) * BLOCK_M
    if m_start >= T * GROUP:
        return
    cache_len = tl.load(cache_lens_ptr + seq).to(tl.int32)
    # int64: slot offsets into a whole pool layer can pass 2**31 elements.
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if HAS_TREE:
        is_tree = tl.load(causal_ptr + seq).to(tl.int32) == 0
    else:
        is_tree = False
    _attend_block(
        q_ptr + row_start * stride_qt,
        k_ptr + slot * stride_kslot + kvh * stride_kh,
        v_ptr + slot * stride_vslot + kvh * stride_vh,
        o_ptr + row_start * stride_ot,
        mask_ptr + row_start,
        stride_qt, stride_qh, stride_qd, stride_ks, stride_kd, stride_vs, stride_vd,
        stride_ot, stride_oh, stride_od,
        cache_len, T, m_start, kvh, GROUP, qk_scale, is_tree,
        HEAD_DIM, BLOCK_M, BLOCK_N, DOT_PRECISION,
    )


# The interpreter wraps kernels in InterpretedFunction instead of JITFunction; CPU
# tensors are only usable in that mode.
_INTERPRETED = not isinstance(_tree_attention_kernel, triton.runtime.JITFunction)


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
        if tree_mask.dtype != torch.int64 or tree_mask.shape != (T,):
            raise ValueError(f"tree_mask must be int64 [T={T}], got {tree_mask.dtype} "
                             f"{tuple(tree_mask.shape)}")
        if tree_mask.device != q.device:
            raise ValueError(f"tree_mask on {tree_mask.device}, q on {q.device}")
        if T > _MAX_TREE_ROWS:
            raise ValueError(f"a tree mask supports at most {_MAX_TREE_ROWS} rows, got T={T}; "
                             f"use tree_mask=None (causal) for prefill")
    if for_kernel:
        _check_kernel_inputs(q, "tree_attention")


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


def tree_attention(q, k_cache, v_cache, cache_len: int, tree_mask, scale: float | None = None) -> torch.Tensor:
    """Triton tree/causal attention; see the module docstring. Returns [T, H, D] in q.dtype."""
    _check_inputs(q, k_cache, v_cache, cache_len, tree_mask, for_kernel=True)
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

    grid = (triton.cdiv(packed_rows, block_m), H_kv)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out, mask_arg,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        cache_len, T, group, float(scale) * math.log2(math.e),
        HAS_MASK=tree_mask is not None,
        HEAD_DIM=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        num_warps=num_warps,
    )
    return out


def tree_attention_ref(q, k_cache, v_cache, cache_len: int, tree_mask, scale: float | None = None) -> torch.Tensor:
    """Plain-torch reference with the same signature and semantics as tree_attention."""
    _check_inputs(q, k_cache, v_cache, cache_len, tree_mask, for_kernel=False)
    T, H, D = q.shape
    H_kv = k_cache.shape[0]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    n_keys = cache_len + T
    k = k_cache[:, :n_keys].float().repeat_interleave(H // H_kv, dim=0)  # [H, n_keys, D]
    v = v_cache[:, :n_keys].float().repeat_interleave(H // H_kv, dim=0)  # [H, n_keys, D]
    qh = q.float().transpose(0, 1)  # [H, T, D]
    scores = (qh @ k.transpose(1, 2)) * scale  # [H, T, n_keys]
    visible = tree_mask_to_bool(tree_mask, cache_len, T).to(q.device)  # [T, n_keys]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [H, T, D]
    return out.transpose(0, 1).to(q.dtype)


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
        if tree_mask.dtype != torch.int64 or tree_mask.shape != (T_total,):
            raise ValueError(f"tree_mask must be int64 [T_total={T_total}], got {tree_mask.dtype} "
                             f"{tuple(tree_mask.shape)}")
        if tree_mask.device != q.device:
            raise ValueError(f"tree_mask on {tree_mask.device}, q on {q.device}")
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


def tree_attention_batched(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal,
                           scale: float | None = None) -> torch.Tensor:
    """Tree/causal attention for the rows of B sequences, one layer, one launch. Returns [T_total, H, D].

    q [T_total, H, D]: every sequence's new rows back to back. k_layer, v_layer [num_slots, H_kv, S, D]: one
    layer of the KV pool (e.g. ``pool_k[layer]``), new rows already written at cache_len + j of their slot.
    slots [B], cache_lens [B], row_starts [B + 1] (int32/int64, on q's device): sequence b owns rows
    row_starts[b]:row_starts[b + 1] and KV slot slots[b], whose first cache_lens[b] rows are its verified prefix.
    tree_mask [T_total] int64: ancestor bits of each row relative to its sequence's first row (ignored where
    causal[b]); causal [B] bool/int: that sequence's rows are causal among themselves (prefill chunk, any count).
    tree_mask=None means every sequence is causal (causal may then be None; it is not read).
    Build these once per forward and share them across layers; see the module docstring for limits.
    """
    _check_batched_inputs(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal, for_kernel=True)
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

    grid = (T_total * group // block_m + B, H_kv)
    _tree_attention_batched_kernel[grid](
        q, k_layer, v_layer, out, mask_arg,
        slots, cache_lens, row_starts, causal_arg,
        q.stride(0), q.stride(1), q.stride(2),
        k_layer.stride(0), k_layer.stride(1), k_layer.stride(2), k_layer.stride(3),
        v_layer.stride(0), v_layer.stride(1), v_layer.stride(2), v_layer.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        B, group, float(scale) * math.log2(math.e),
        HAS_TREE=has_tree,
        BLOCK_B=max(16, triton.next_power_of_2(B)),
        HEAD_DIM=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        num_warps=num_warps,
    )
    return out


def tree_attention_batched_ref(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal,
                               scale: float | None = None) -> torch.Tensor:
    """Plain-torch reference for tree_attention_batched: tree_attention_ref once per sequence."""
    _check_batched_inputs(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal, for_kernel=False)
    B = row_starts.shape[0] - 1
    starts, lens, slot_list = row_starts.tolist(), cache_lens.tolist(), slots.tolist()
    flags = [True] * B if tree_mask is None else [bool(c) for c in causal.tolist()]
    out = torch.zeros_like(q)  # [T_total, H, D]
    for b in range(B):
        a, e = starts[b], starts[b + 1]
        if a == e:
            continue
        mask = None if flags[b] else tree_mask[a:e]
        out[a:e] = tree_attention_ref(q[a:e], k_layer[slot_list[b]], v_layer[slot_list[b]], lens[b], mask, scale)
    return out


def ancestor_bitmask(parents) -> torch.Tensor:
    """int64 [T] masks: bit j of row i set iff node j is node i or one of its ancestors.

    parents[0] must be -1 (root) and every other parent index must precede its child.
    """
    if isinstance(parents, torch.Tensor):
        if parents.dim() != 1:
            raise ValueError(f"parents must be 1-D, got shape {tuple(parents.shape)}")
        parents = parents.tolist()
    parents = [int(p) for p in parents]
    T = len(parents)
    if T == 0 or T > _MAX_TREE_ROWS:
        raise ValueError(f"tree must have 1..{_MAX_TREE_ROWS} nodes, got {T}")
    if parents[0] != -1:
        raise ValueError(f"parents[0] must be -1 (root), got {parents[0]}")
    masks = [1]
    for i in range(1, T):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: parents must be in [0, {i}) (topological order)")
        masks.append(masks[p] | (1 << i))
    # Python ints are unbounded; fold bit 63 into the int64 sign.
    return torch.tensor([m - (1 << 64) if m >> 63 else m for m in masks], dtype=torch.int64)


def tree_mask_to_bool(tree_mask, cache_len: int, T: int) -> torch.Tensor:
    """Bool [T, cache_len + T], True = visible. tree_mask=None means causal new rows."""
    device = tree_mask.device if tree_mask is not None else None
    cols = torch.arange(T, device=device)  # [T]
    if tree_mask is None:
        new = cols[None, :] <= cols[:, None]  # [T, T]
    else:
        if tree_mask.shape != (T,):
            raise ValueError(f"tree_mask must have shape [{T}], got {tuple(tree_mask.shape)}")
        # >> on int64 is arithmetic, so bit 63 comes back as -1; `& 1` still isolates it.
        new = ((tree_mask.to(torch.int64)[:, None] >> cols[None, :]) & 1).bool()  # [T, T]
    prefix = torch.ones((T, cache_len), dtype=torch.bool, device=new.device)  # [T, cache_len]
    return torch.cat([prefix, new], dim=1)
