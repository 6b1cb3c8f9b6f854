"""Tree masks for tree attention: a draft tree's parent list as int64 ancestor bits, one word per row
(ancestor_bitmask), and those bits as the boolean visibility of the verified prefix and the new rows
(tree_mask_to_bool, which the references and the engine's torch attention use).

A tree has at most 64 rows: one int64 word of ancestor bits per row, bit 63 being the sign bit.
"""

from __future__ import annotations

import torch

_MAX_TREE_ROWS = 64


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
