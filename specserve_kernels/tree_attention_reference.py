"""Plain-torch references for tree attention, with the signatures and semantics of the Triton launchers in
specserve_kernels.tree_attention: tree_attention_ref for one sequence and tree_attention_batched_ref, which runs it once per
sequence. They run on any device (the CPU included) and are what the kernels are tested and benchmarked against.
"""

from __future__ import annotations

import math

import torch

from .tree_attention_checks import _check_batched_inputs, _check_inputs, _check_window
from .tree_mask import tree_mask_to_bool


def tree_attention_ref(q, k_cache, v_cache, cache_len: int, tree_mask, scale: float | None = None,
                       window: int | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference with the same signature and semantics as tree_attention."""
    _check_inputs(q, k_cache, v_cache, cache_len, tree_mask, for_kernel=False)
    _check_window(q, window, positions)
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
    if window is not None:  # key positions: prefix row n at n, new rows at theirs
        key_pos = torch.cat([torch.arange(cache_len, device=q.device), positions.to(q.device)])  # [n_keys]
        visible = visible & (key_pos[None, :] > positions.to(q.device)[:, None] - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [H, T, D]
    return out.transpose(0, 1).to(q.dtype)


def tree_attention_batched_ref(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal,
                               scale: float | None = None, window: int | None = None,
                               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference for tree_attention_batched: tree_attention_ref once per sequence."""
    _check_batched_inputs(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal, for_kernel=False)
    _check_window(q, window, positions)
    B = row_starts.shape[0] - 1
    starts, lens, slot_list = row_starts.tolist(), cache_lens.tolist(), slots.tolist()
    flags = [True] * B if tree_mask is None else [bool(c) for c in causal.tolist()]
    out = torch.zeros_like(q)  # [T_total, H, D]
    for b in range(B):
        a, e = starts[b], starts[b + 1]
        if a == e:
            continue
        mask = None if flags[b] else tree_mask[a:e]
        out[a:e] = tree_attention_ref(q[a:e], k_layer[slot_list[b]], v_layer[slot_list[b]], lens[b], mask, scale,
                                      window, None if window is None else positions[a:e])
    return out
