"""Weight-only quantization of the target (``model.quantization: int8 | int4``), applied once after loading.

Every linear layer of every block and the LM head are replaced by packed matrices (``core.ops.Int8Weight`` per output
channel, ``core.ops.Int4Weight`` per group of 32 input columns) that ``core.ops.linear`` multiplies with the kernels
PyTorch ships; the embedding, norms and attention stay in the serving dtype. The quantized model is the target:
speculative decoding is lossless with respect to it (greedy speculative == greedy plain with the same quantization).
"""
from __future__ import annotations

import torch
from torch import nn

from core.ops import QUANTIZATIONS, Int4Weight, Int8Weight

INT4_GROUP = 32  # GGUF's Q4 block length, and the smallest group PyTorch's packed int4 kernels take


class PackedLinear(nn.Module):
    """Stands where an ``nn.Linear`` stood; ``weight`` is the packed matrix ``core.ops.linear`` dispatches on."""

    def __init__(self, weight: Int8Weight | Int4Weight):
        super().__init__()
        self.weight = weight


def quantize_model(model: nn.Module, kind: str, dtype: torch.dtype) -> None:
    """Quantize ``model`` (a ``server.engine.model.Llama`` already on its device) in place."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {kind!r}; valid: {', '.join(QUANTIZATIONS)}")
    if kind == "none":
        return

    def pack(w: torch.Tensor) -> PackedLinear:
        if kind == "int8":
            return PackedLinear(Int8Weight.quantize(w, dtype))
        return PackedLinear(Int4Weight.quantize(w, dtype, INT4_GROUP))

    with torch.no_grad():
        for layer in model.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                setattr(layer, name, pack(getattr(layer, name).weight))
        model.lm_head = pack(model.lm_head.weight)  # a tied head keeps the embedding as it was
