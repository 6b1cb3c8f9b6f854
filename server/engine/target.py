"""The loaded target model: its forward passes and the read-only pieces drafters and training share.

Loading it (weights, serving dtype and quantization chosen by measurement on this machine) is
``server.engine.startup``'s.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from core.ops import LlamaArgs, rms_norm
from server.engine.backend import make_attention, windowed
from server.engine.model import Llama, Segment


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class TargetPass(NamedTuple):
    """One causal forward over a whole sequence (``Target.forward``)."""

    hidden: torch.Tensor  # [T, hidden] the last layer's output, before the final norm
    k: torch.Tensor       # [layers, kv_heads, T, head_dim] post-RoPE keys
    v: torch.Tensor       # [layers, kv_heads, T, head_dim]
    taps: torch.Tensor | None = None  # [T, len(taps), hidden] the residual stream after each tapped layer count


class Target:
    """The frozen target model plus the read-only pieces drafters may share (implements drafters.base.TargetView)."""

    def __init__(self, model: Llama, model_id: str, device: torch.device, dtype: torch.dtype, hf_dir=None,
                 gguf=None):
        self.model, self.model_id, self.device, self.dtype = model, model_id, device, dtype
        self.hf_dir = hf_dir  # config and tokenizer files (and the weights, unless they are a GGUF file's)
        self.gguf = gguf      # the GGUF file holding the weights, if the source is one
        self.quantization = "none"  # what load_target served (model.quantization: auto resolved)
        self.args: LlamaArgs = model.args

    @property
    def kernels(self) -> str:
        """"qlinear" where the linear layers run the CPU block-quantized kernel (a float32 engine then runs every row
        through ``specserve_kernels.cpu.decoder``, its row-invariant attention included), else "aten"."""
        from specserve_kernels.cpu import BlockQuantWeight

        return "qlinear" if isinstance(self.model.layers[0].wqkv.weight, BlockQuantWeight) else "aten"

    @property
    def max_positions(self) -> int:
        """The longest sequence the model's RoPE table covers (the configured context)."""
        return int(self.model.rope.cos.shape[0])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor | list[int], taps: tuple[int, ...] = ()) -> TargetPass:
        """One causal forward over ``tokens`` from position 0, outside the KV slots of serving (training's teacher
        passes read it): the hidden states, every layer's K/V and, for each n in ``taps``, the residual stream after
        the first n layers."""
        return self.forward_many([tokens], taps)[0]

    @torch.inference_mode()
    def forward_many(self, seqs: list[torch.Tensor | list[int]], taps: tuple[int, ...] = ()) -> list[TargetPass]:
        """``forward`` of several sequences in one pass: their rows back to back, one segment each (each weight's
        matmul takes every row at once; attention reads each sequence's own K/V). One ``TargetPass`` per sequence,
        the values ``forward`` gives alone up to the matmuls' rounding."""
        a, dev = self.args, self.device
        ids = [torch.as_tensor(s, dtype=torch.long, device=dev) for s in seqs]
        segments, start = [], 0
        for n in map(len, ids):
            k = torch.zeros(a.num_layers, a.num_kv_heads, n, a.head_dim, dtype=self.dtype, device=dev)
            local = make_attention(dev, 0, n, None, self.dtype, window=a.window) if windowed(a.window, 0, n) else None
            segments.append(Segment(start, start + n, k, torch.zeros_like(k), 0, None,
                                    make_attention(dev, 0, n, None, self.dtype), local))
            start += n
        positions = torch.cat([torch.arange(len(x), device=dev) for x in ids])
        tapped = dict.fromkeys(taps)
        hidden = self.model(torch.cat(ids), positions, segments, taps=tapped)
        stacked = torch.stack([tapped[n] for n in taps], 1) if taps else None
        return [TargetPass(hidden[s.start:s.end], s.k, s.v, stacked[s.start:s.end] if taps else None)
                for s in segments]

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    @torch.inference_mode()
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.model.norm, self.args.rms_norm_eps)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.rope(x, positions)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.embed.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        w = self.model.lm_head.weight
        return w if isinstance(w, torch.Tensor) else w.dequantize()  # a quantized head: the matrix it stands for
