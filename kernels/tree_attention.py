"""Tree attention for speculative-decoding verification (and causal prefill).

Computes softmax(q k^T * scale) v for the T new rows of ONE sequence in ONE layer:
every new row sees the whole verified prefix cache[0:cache_len], plus the new rows
that the tree mask marks visible (its ancestors and itself). With tree_mask=None the
new rows are causal among themselves, which is what prefill (T in the thousands) needs.

- dtypes: float16 / bfloat16 / float32 in, same dtype out; scores, softmax and the
  output accumulator are float32 (P is rounded to the input dtype for the P@V dot,
  as in flash attention).
- head dims: any power of two in [16, 256] (models here use 64 and 128).
- GQA: H % H_kv == 0, query head h reads kv head h // (H // H_kv).
- limits: with a tree mask T <= 64 (one int64 word of ancestor bits per row, bit 63
  is the sign bit). No split-K over the prefix yet, so a decode step with few kv
  heads launches few programs and long prefixes are latency-bound on a big GPU.
- a row that sees no key at all (cache_len == 0 and a mask without its self bit)
  gets zeros; the reference gives NaN there.
- float32 inputs use exact ("ieee") dots on small tiles: correct but slow, for tests.
- tested under TRITON_INTERPRET=1 on CPU (float32 and float16 only: the interpreter's
  tl.dot multiplies bfloat16 as raw uint16 bits); compiled ahead of time for sm_90 with
  Triton 3.6 and 3.9 (no register spills for 16-bit inputs); no GPU timing yet.
"""

from __future__ import annotations

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
    # Grid is (row blocks, kv heads), and the M dimension packs (new row, query head in
    # the GQA group) pairs, t-major. Why: a decode/verify step has T in 1..64, far below
    # a 16-row dot tile; packing the group fills the tile (T=1, G=8 -> 8 useful rows
    # instead of 1) and every K/V tile is loaded once per group instead of G times.
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] packed t * GROUP + g
    row_ok = rows < T * GROUP
    t = rows // GROUP  # [BLOCK_M] new-row index
    head = kvh * GROUP + rows % GROUP  # [BLOCK_M] query head
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(
        q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None], other=0.0,
    )  # [BLOCK_M, D]
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh

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

    if HAS_MASK:
        row_bits = tl.load(mask_ptr + t, mask=row_ok, other=0)  # [BLOCK_M] int64
        n_end = T
    else:
        # Causal: no row of this block sees a new row past its own last t.
        n_end = tl.minimum(T, (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP + 1)

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
        if HAS_MASK:
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


# The interpreter wraps kernels in InterpretedFunction instead of JITFunction; CPU
# tensors are only usable in that mode.
_INTERPRETED = not isinstance(_tree_attention_kernel, triton.runtime.JITFunction)


def _check_inputs(q, k_cache, v_cache, cache_len, tree_mask, *, for_kernel: bool) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(f"expected q [T, H, D] and k/v_cache [H_kv, S, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q dtype must be float16/bfloat16/float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"device mismatch: q {q.device}, k {k_cache.device}, v {v_cache.device}")
    T, H, D = q.shape
    H_kv, S, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"head dim mismatch: q {D}, cache {Dk}")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {H_kv}")
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
        if D < 16 or D > 256 or D & (D - 1):
            raise ValueError(f"head dim must be a power of two in [16, 256], got {D}")
        if not q.is_cuda and not _INTERPRETED:
            raise RuntimeError("tree_attention needs CUDA tensors (or TRITON_INTERPRET=1 set "
                               "before triton is imported); use tree_attention_ref on CPU")


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
    if q.dtype == torch.float32:
        # "ieee" keeps float32 exact (TF32 tensor cores would give ~1e-3 relative error),
        # but it lowers to FMA loops: sm_90 builds of larger tiles spill registers.
        precision, block_m, block_n, num_warps = "ieee", 16, 32, 8
    else:
        precision = "tf32"  # ignored for 16-bit inputs
        block_m = 64 if packed_rows > 32 else max(16, triton.next_power_of_2(packed_rows))
        block_n = 64 if D <= 128 else 32  # a 256-wide head's K/V tiles must stay in registers
        num_warps = 4 if D <= 64 else 8
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
