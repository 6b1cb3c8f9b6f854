"""Weight-only quantization of the target (``model.quantization: int8 | int4``), applied once after loading.

Every linear layer of every block and the LM head are replaced by packed matrices (``core.ops.Int8Weight`` per output
channel, ``core.ops.Int4Weight`` per group of 32 input columns) that ``core.ops.linear`` multiplies with the kernels
PyTorch ships; the embedding, norms and attention stay in the serving dtype. The quantized model is the target:
speculative decoding is lossless with respect to it (greedy speculative == greedy plain with the same quantization).

Where the source is a GGUF file with Q4_1 blocks (the embedded model), int4 takes the file's own blocks (scale d,
zero m + 8 d) instead of re-quantizing the weights de-quantized from them, so that with float32 activations the served
matrices are exactly the file's. Re-quantizing gives the same blocks back only where the file's quantizer also took
each block's min and max (llama.cpp without an importance matrix: the embedded file, whose re-quantized packing is
bit-identical); one that fits scale and min (llama.cpp with an importance matrix) leaves codes 0 or 15 unused, and
re-quantizing would round every weight a second time.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from core.ops import QUANTIZATIONS, Int4Weight, Int8Weight
from server.engine.weights import Q4Blocks, gguf_linear_blocks

INT4_GROUP = 32  # GGUF's Q4 block length, and the smallest group PyTorch's packed int4 kernels take


class PackedLinear(nn.Module):
    """Stands where an ``nn.Linear`` stood; ``weight`` is the packed matrix ``core.ops.linear`` dispatches on."""

    def __init__(self, weight: Int8Weight | Int4Weight):
        super().__init__()
        self.weight = weight


def quantize_model(model: nn.Module, kind: str, dtype: torch.dtype, gguf: Path | None = None) -> None:
    """Quantize ``model`` (a ``server.engine.model.Llama`` already on its device) in place.

    ``gguf``: the file the weights were converted from; for int4, every matrix whose parts it holds as Q4_1 blocks
    is built from those blocks (the rest is quantized from the dense weights as usual).
    """
    if kind not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {kind!r}; valid: {', '.join(QUANTIZATIONS)}")
    if kind == "none":
        return
    blocks = gguf_linear_blocks(gguf) if kind == "int4" and gguf is not None else {}

    def pack(w: torch.Tensor, parts: list[str]) -> PackedLinear:
        """``parts``: the transformers names whose rows, concatenated, make up ``w``."""
        if kind == "int8":
            return PackedLinear(Int8Weight.quantize(w, dtype))
        if parts and all(p in blocks for p in parts):
            return PackedLinear(int4_from_blocks([blocks[p] for p in parts], w, dtype))
        return PackedLinear(Int4Weight.quantize(w, dtype, INT4_GROUP))

    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            parts = {"wqkv": [p + f"self_attn.{n}_proj.weight" for n in "qkv"], "wo": [p + "self_attn.o_proj.weight"],
                     "w_gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                     "w_down": [p + "mlp.down_proj.weight"]}  # the fused layout of Llama.load_hf_state_dict
            for name, names in parts.items():
                setattr(layer, name, pack(getattr(layer, name).weight, names))
        # a tied head keeps the embedding as it was (a GGUF file stores no head of its own then)
        model.lm_head = pack(model.lm_head.weight, [] if model.args.tie_word_embeddings else ["lm_head.weight"])


def int4_from_blocks(parts: list[Q4Blocks], w: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """Q4_1 blocks (d * q + m), rows concatenated, as the packed int4 matrix standing for ``w`` [N, K]: scale d,
    zero m + 8 d. ``w`` only supplies the expected shape and the device."""
    q, d, m = (torch.cat(x, dim=0).to(w.device) for x in zip(*parts))  # [N, K], [N, K / 32] x 2
    if tuple(q.shape) != tuple(w.shape):
        raise ValueError(f"int4: the file's blocks form a {tuple(q.shape)} matrix where the model has {tuple(w.shape)}")
    return Int4Weight.from_groups(q, d, m + 8.0 * d, dtype, INT4_GROUP)
