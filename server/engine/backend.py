"""Where the engine picks its attention and KV-compaction implementations.

CUDA runs the Triton kernels; CPU runs PyTorch's SDPA with a boolean mask (built once per forward and shared by
every layer) and the plain-torch compaction reference. Kernel choice lives here, at the call site, so the model code
stays plain eager PyTorch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kv_compact import kv_compact, kv_compact_ref
from kernels.tree_attention import tree_attention, tree_mask_to_bool


def make_attention(device: torch.device, cache_len: int, num_rows: int, tree_mask: torch.Tensor | None):
    """An attention function for one forward of ``num_rows`` new rows after ``cache_len`` cached ones."""
    if device.type == "cuda":
        return tree_attention

    if num_rows == 1:
        mask, causal = None, False  # one row sees the whole prefix and itself
    elif cache_len == 0 and tree_mask is None:
        mask, causal = None, True
    else:
        mask, causal = tree_mask_to_bool(tree_mask, cache_len, num_rows).to(device), False  # [T, cache_len + T]

    def sdpa(q, k_cache, v_cache, cache_len_, tree_mask_):
        # q: [T, H, D]; k_cache, v_cache: [H_kv, S, D]
        end = cache_len + num_rows
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k_cache[None, :, :end], v_cache[None, :, :end],
            attn_mask=mask, is_causal=causal, enable_gqa=True)  # [1, H, T, D]
        return out[0].transpose(0, 1)

    return sdpa


def compact_kv(k: torch.Tensor, v: torch.Tensor, slot: int, src_rows: torch.Tensor, dst_start: int) -> None:
    """Move accepted rows of every layer into place (k, v: [L, slots, H_kv, S, D])."""
    (kv_compact if k.device.type == "cuda" else kv_compact_ref)(k, v, slot, src_rows, dst_start)
