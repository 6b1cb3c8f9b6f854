"""Triton kernels for specserve: tree attention for speculative verification and KV compaction."""

from .kv_compact import kv_compact, kv_compact_ref
from .tree_attention import tree_attention
from .tree_attention_reference import tree_attention_ref
from .tree_mask import ancestor_bitmask, tree_mask_to_bool

__all__ = [
    "tree_attention",
    "tree_attention_ref",
    "ancestor_bitmask",
    "tree_mask_to_bool",
    "kv_compact",
    "kv_compact_ref",
]
