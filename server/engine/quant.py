"""Weight-only quantization of the target (``model.quantization: int8 | int4``), applied once after loading.

Every linear layer of every block and the LM head are replaced by packed matrices; the embedding, norms and attention
stay in the serving dtype. The quantized model is the target: speculative decoding is lossless with respect to it
(greedy speculative == greedy plain with the same quantization).

Two kernel paths, chosen at load:

- **qlinear** (``specserve_kernels.cpu``, x86 CPUs with AVX-512 VNNI): weights as codes per block of 32 input columns (int4:
  asymmetric, as GGUF Q4_1; int8: symmetric, as GGUF Q8_0), activations quantized to int8 per row and block, integer
  dot products. Every weight is read once per step for all its rows, and a row's result does not depend on the other
  rows. This is the design of llama.cpp's own CPU kernels, so a GGUF file served here computes what llama.cpp computes
  from it, up to float summation order.
- **PyTorch's packed kernels** everywhere else (``core.ops.Int8Weight`` per output channel, ``core.ops.Int4Weight``
  per group of 32), with activations in the serving dtype.

Where the source is a GGUF file, its own blocks are served instead of re-quantizing the weights de-quantized from
them: the Q4_1 linear layers for int4, and on the qlinear path also the Q8_0 matrices (a tied head multiplies by the
file's Q8_0 token embedding, as llama.cpp does). Re-quantizing gives the same Q4_1 blocks back only where the file's
quantizer also took each block's min and max (llama.cpp without an importance matrix: the embedded file); one that fits
scale and min leaves codes 0 or 15 unused, and re-quantizing would round every weight a second time.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from core.ops import QUANTIZATIONS, Int4Weight, Int8Weight
from specserve_kernels import cpu as qlinear
from server.engine.weights import QBlocks, gguf_linear_blocks, gguf_linear_quantization
from server.gguf_file import GGUFFile

log = logging.getLogger(__name__)

INT4_GROUP = 32  # GGUF's Q4 block length, and the smallest group PyTorch's packed int4 kernels take


class PackedLinear(nn.Module):
    """Stands where an ``nn.Linear`` stood; ``weight`` is the packed matrix ``core.ops.linear`` dispatches on."""

    def __init__(self, weight: "Int8Weight | Int4Weight | qlinear.BlockQuantWeight"):
        super().__init__()
        self.weight = weight


def kernel_path(kind: str, device: torch.device) -> str:
    """Which kernels a ``kind``-quantized model on ``device`` runs: "qlinear" or "aten" (PyTorch's packed kernels)."""
    if kind == "none" or device.type != "cpu":
        return "aten"
    return "qlinear" if qlinear.load() is not None else "aten"


def resolve_quantization(kind: str, device: torch.device, gguf: "GGUFFile | Path | None") -> str:
    """``model.quantization: auto``: on CPU, a GGUF source's own quantization (int4 for Q4_1 layers, int8 for Q8_0:
    what llama.cpp serves from the file, several times cheaper per step than de-quantized weights); unquantized for
    any other source (quantizing it would change the model) and on GPUs."""
    if kind != "auto":
        return kind
    if device.type != "cpu" or gguf is None:
        return "none"
    return gguf_linear_quantization(gguf) or "none"


def quantize_model(model: nn.Module, kind: str, dtype: torch.dtype, gguf: "GGUFFile | Path | None" = None,
                   kernels: str | None = None, int4_form: str = "packed") -> str:
    """Quantize ``model`` (a ``server.engine.model.Llama`` already on its device) in place; returns the kernel path
    (``kernel_path``, or ``kernels`` where given: "aten" forces PyTorch's packed kernels).

    ``gguf``: the file the weights were read from; every matrix whose parts it holds as blocks of the kind served
    is built from those blocks (the rest is quantized from the dense weights as usual). ``int4_form``: the form of
    PyTorch's path's int4 matrices (``core.ops.Int4Weight``; ``server.engine.stepcost.choose_int4_form`` measures it).
    """
    if kind not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {kind!r}; valid: {', '.join(QUANTIZATIONS)}")
    if kind == "none":
        return "aten"
    path = kernels or kernel_path(kind, model.embed.weight.device)
    if path == "aten" and kernels is None and model.embed.weight.device.type == "cpu":
        log.info("quantization %s: PyTorch's packed kernels (the qlinear kernel is unavailable: %s)", kind,
                 qlinear.unavailable_reason())
    bits = 4 if kind == "int4" else 8
    blocks = gguf_linear_blocks(gguf) if gguf is not None and (kind == "int4" or path == "qlinear") else {}

    def from_file(parts: list[str], want_bits: int) -> list[QBlocks] | None:
        if parts and all(p in blocks and blocks[p].bits == want_bits for p in parts):
            return [blocks[p] for p in parts]
        return None

    def pack(w: torch.Tensor, parts: list[str], head: bool = False) -> PackedLinear:
        """``parts``: the transformers names whose rows, concatenated, make up ``w``."""
        if path == "qlinear":
            # a head keeps the file's 8-bit blocks where it has them (llama.cpp's Q8_0 output / token embedding)
            for want in ((bits, 8) if head else (bits,)):
                stored = from_file(parts, want)
                if stored is not None:
                    return PackedLinear(blocks_weight(stored, w))
            return PackedLinear(qlinear.BlockQuantWeight.quantize(w, bits))
        if kind == "int8":
            return PackedLinear(Int8Weight.quantize(w, dtype))
        stored = from_file(parts, 4)
        if stored is not None:
            return PackedLinear(int4_from_blocks(stored, w, dtype, int4_form))
        return PackedLinear(Int4Weight.quantize(w, dtype, INT4_GROUP, int4_form))

    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            parts = {"wqkv": [p + f"self_attn.{n}_proj.weight" for n in "qkv"], "wo": [p + "self_attn.o_proj.weight"],
                     "w_gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                     "w_down": [p + "mlp.down_proj.weight"]}  # the fused layout of Llama.load_hf_state_dict
            for name, names in parts.items():
                setattr(layer, name, pack(getattr(layer, name).weight, names))
        # a tied head multiplies by the embedding (a GGUF file then stores no head of its own); the embedding lookup
        # itself stays dense
        head = ["model.embed_tokens.weight" if model.args.tie_word_embeddings else "lm_head.weight"]
        if path == "aten" and model.args.tie_word_embeddings:
            head = []  # PyTorch's path quantizes the tied head from the dense embedding, as before the file's blocks
        model.lm_head = pack(model.lm_head.weight, head, head=True)
    return path


def _stack(parts: list[QBlocks], w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, d, m = (torch.cat(x, dim=0) for x in zip(*[(b.q, b.d, b.m) for b in parts]))
    if tuple(q.shape) != tuple(w.shape):
        raise ValueError(f"the file's blocks form a {tuple(q.shape)} matrix where the model has {tuple(w.shape)}")
    return q, d, m


def blocks_weight(parts: list[QBlocks], w: torch.Tensor) -> "qlinear.BlockQuantWeight":
    """The file's blocks (rows concatenated, one kind) as the qlinear kernel's matrix standing for ``w`` [N, K]."""
    q, d, m = _stack(parts, w)
    return qlinear.BlockQuantWeight.from_blocks(q, d, m, parts[0].bits)


def int4_from_blocks(parts: list[QBlocks], w: torch.Tensor, dtype: torch.dtype, form: str = "packed") -> Int4Weight:
    """Q4_1 blocks (d * q + m), rows concatenated, as the int4 matrix standing for ``w`` [N, K] in ``form``: scale d,
    low m. ``w`` only supplies the expected shape and the device."""
    q, d, m = (x.to(w.device) for x in _stack(parts, w))
    return Int4Weight.from_groups(q.to(torch.int32), d, m, dtype, INT4_GROUP, form)
