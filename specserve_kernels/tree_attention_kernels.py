"""The Triton kernels of tree attention, launched by specserve_kernels.tree_attention (see its docstring for the semantics
and limits): the block step shared by both (one row block of one sequence against its verified prefix and its new
rows, with an online softmax), the single-sequence kernel and the batched kernel, which finds each program's sequence
from the row offsets on the device.

Whether Triton interprets these kernels (TRITON_INTERPRET=1, CPU tensors) or compiles them is fixed when this module
is imported: _INTERPRETED says which.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    q_ptr, k_base, v_base, o_ptr, mask_ptr, pos_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kd,
    stride_vs, stride_vd,
    stride_ot, stride_oh, stride_od,
    cache_len, T, m_start, kvh, GROUP, qk_scale, is_tree, window,
    HAS_WINDOW: tl.constexpr,
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
    # HAS_WINDOW (a sliding-window layer): pos_ptr holds the new rows' positions (cache row n of the prefix is at
    # position n), and a row at position p sees only keys at positions > p - window.
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

    # Verified prefix: visible to every row, so only the tail tile needs a bound mask; with a window, the rows'
    # lowest visible position too, and the tiles before the block's lowest one are skipped.
    prefix_start = 0
    if HAS_WINDOW:
        lo = tl.load(pos_ptr + t, mask=row_ok, other=0).to(tl.int32) - window + 1  # [BLOCK_M] first visible position
        lo_block = tl.maximum(tl.min(tl.where(row_ok, lo, cache_len), 0), 0)
        prefix_start = lo_block // BLOCK_N * BLOCK_N
    for start in range(prefix_start, cache_len, BLOCK_N):
        n = start + offs_n  # [BLOCK_N] absolute cache row
        n_ok = n < cache_len
        k = tl.load(k_base + n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                    mask=n_ok[None, :], other=0.0)  # [D, BLOCK_N]
        v = tl.load(v_base + n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None], other=0.0)  # [BLOCK_N, D]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        seen = n_ok[None, :]
        if HAS_WINDOW:
            seen = seen & (n[None, :] >= lo[:, None])
        s = tl.where(seen, s, float("-inf"))
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
        if HAS_WINDOW:
            key_pos = tl.load(pos_ptr + j, mask=j_ok, other=0).to(tl.int32)  # [BLOCK_N]
            visible = visible & (key_pos[None, :] >= lo[:, None])
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
    q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, pos_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kh, stride_ks, stride_kd,
    stride_vh, stride_vs, stride_vd,
    stride_ot, stride_oh, stride_od,
    cache_len, T, GROUP, qk_scale, window,
    HAS_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grid is (row blocks, kv heads) of the one sequence.
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    _attend_block(
        q_ptr, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, o_ptr, mask_ptr, pos_ptr,
        stride_qt, stride_qh, stride_qd, stride_ks, stride_kd, stride_vs, stride_vd,
        stride_ot, stride_oh, stride_od,
        cache_len, T, pid_m * BLOCK_M, kvh, GROUP, qk_scale, HAS_MASK, window,
        HAS_WINDOW, HEAD_DIM, BLOCK_M, BLOCK_N, DOT_PRECISION,
    )


# B changes every step (see _tree_attention_kernel on do_not_specialize).
@triton.jit(do_not_specialize=["B"])
def _tree_attention_batched_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, pos_ptr,
    slots_ptr, cache_lens_ptr, row_starts_ptr, causal_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kslot, stride_kh, stride_ks, stride_kd,
    stride_vslot, stride_vh, stride_vs, stride_vd,
    stride_ot, stride_oh, stride_od,
    B, GROUP, qk_scale, window,
    HAS_TREE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
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
        pos_ptr + row_start,
        stride_qt, stride_qh, stride_qd, stride_ks, stride_kd, stride_vs, stride_vd,
        stride_ot, stride_oh, stride_od,
        cache_len, T, m_start, kvh, GROUP, qk_scale, is_tree, window,
        HAS_WINDOW, HEAD_DIM, BLOCK_M, BLOCK_N, DOT_PRECISION,
    )


# The interpreter wraps kernels in InterpretedFunction instead of JITFunction; CPU
# tensors are only usable in that mode.
_INTERPRETED = not isinstance(_tree_attention_kernel, triton.runtime.JITFunction)
