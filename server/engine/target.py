"""The loaded target model: weights in the serving dtype and quantization, the dtype and kernel measurements that
choose them on this machine, and the read-only pieces drafters and training share.

``model.dtype: auto`` measures the candidate dtypes on this machine first (``server.engine.stepcost``).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import NamedTuple

import torch

from core.ops import DTYPES, Int4Weight, LlamaArgs, Rope, rms_norm
from server.config import EngineConfig
from server.engine.backend import make_attention
from server.engine.model import Llama, Segment, _local_rope_args
from server.engine.quant import kernel_path, quantize_model, resolve_quantization
from server.engine.stepcost import AUTO_ROWS, choose_dtype, choose_int4_form, step_curve, tune_linear
from server.engine.weights import load_state_dict
from server.model_files import load_hf_config, resolve_model

log = logging.getLogger(__name__)


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

    def __init__(self, model: Llama, model_id: str, device: torch.device, dtype: torch.dtype, hf_dir=None):
        self.model, self.model_id, self.device, self.dtype = model, model_id, device, dtype
        self.hf_dir = hf_dir  # converted HF directory: tokenizer files, and weights for reference runs
        self.quantization = "none"  # what load_target served (model.quantization: auto resolved)
        self.args: LlamaArgs = model.args

    @property
    def kernels(self) -> str:
        """"qlinear" where the linear layers run the CPU block-quantized kernel (a float32 engine then runs every row
        through ``kernels.cpu.decoder``, its row-invariant attention included), else "aten"."""
        from kernels.cpu import BlockQuantWeight

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
            segments.append(Segment(start, start + n, k, torch.zeros_like(k), 0, None,
                                    make_attention(dev, 0, n, None, self.dtype)))
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


def load_target(cfg: EngineConfig, progress: bool = True) -> Target:
    """Build the target model from the config (converting a GGUF source once into the cache).

    ``model.dtype: auto`` measures the candidate dtypes on this machine first (``server.engine.stepcost``).
    """
    resolved = resolve_model(cfg.model.source, cfg.model.cache_dir, progress=progress)
    args = LlamaArgs.from_hf(load_hf_config(resolved.hf_dir))
    args.check_context(cfg.cache.max_seq_len)
    device = resolve_device(cfg.model.device)
    quantization = resolve_quantization(cfg.model.quantization, device, resolved.gguf)
    if quantization != cfg.model.quantization:
        log.info("model.quantization auto: %s (%s kernels on %s)", quantization,
                 kernel_path(quantization, device), device)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, quantization=quantization))
    with torch.device("meta"):  # skip random init: every weight is loaded below
        model = Llama(args, cfg.cache.max_seq_len)
    model.load_hf_state_dict(load_state_dict(resolved.hf_dir))
    model.eval().requires_grad_(False)
    name = cfg.model.dtype
    if name == "auto" and kernel_path(cfg.model.quantization, device) == "qlinear":
        name = "float32"  # the kernel quantizes activations to int8 itself: 16-bit ones would only add casts
        log.info("model.dtype auto: float32 (quantization %s on the qlinear kernel)", cfg.model.quantization)
    if name == "auto":
        name = choose_dtype(lambda d: _measure_dtype(cfg, model, resolved, device, d), device,
                            cfg.model.quantization, resolved.hf_dir)
    target = _build_target(model, resolved, device, name, cfg.model.quantization)
    target.quantization = cfg.model.quantization
    return target


def _build_target(model: Llama, resolved, device: torch.device, dtype_name: str, quantization: str) -> Target:
    dtype = DTYPES[dtype_name]
    model = model.to(device=device, dtype=dtype)
    form = "packed"
    if quantization == "int4" and kernel_path(quantization, device) == "aten" and device.type == "cpu":
        form = choose_int4_form(widest_matrix(model), dtype, resolved.hf_dir)
    kernels = quantize_model(model, quantization, dtype, gguf=resolved.gguf, int4_form=form)
    if quantization != "none":
        log.info("quantization %s on %s (%s kernels%s)", quantization, device, kernels,
                 ", int4 as dense matrices: the packed kernel measured slower here" if form == "dense" else "")
    dense = [w.dense if isinstance(w, Int4Weight) and w.dense is not None else w for w in model.matmul_weights()]
    tune_linear([w for w in dense if isinstance(w, torch.Tensor)], resolved.hf_dir)
    return Target(model, resolved.model_id, device, dtype, resolved.hf_dir)


def widest_matrix(model: Llama) -> tuple[int, int]:
    """The shape [N, K] of the model's largest block matrix (the fused gate/up one)."""
    return max((tuple(getattr(model.layers[0], n).weight.shape) for n in ("wqkv", "wo", "w_gate_up", "w_down")),
               key=lambda s: s[0] * s[1])


AUTO_LAYERS = 4  # the dtype measurement's model: this many of the target's layers, its embedding and its head


def measurement_model(model: Llama, max_len: int) -> Llama:
    """A model of the target's first ``AUTO_LAYERS`` layers (all, for a shallower one), its embedding, final norm and
    head, wrapping the loaded tensors themselves rather than copies: so the dtype measurement never holds a second
    copy of the weights (cast to another dtype, only these layers are). Layers are alike, so the dtypes' ranking
    on it is the whole model's."""
    a = dataclasses.replace(model.args, num_layers=min(model.args.num_layers, AUTO_LAYERS),
                            sliding_layers=tuple(i for i in model.args.sliding_layers if i < AUTO_LAYERS))
    with torch.device("meta"):
        small = Llama(a, max_len)
    small.embed = _sharing_copy(model.embed)
    small.norm = torch.nn.Parameter(model.norm.data, requires_grad=False)
    small.lm_head = _sharing_copy(model.lm_head)
    if a.tie_word_embeddings:
        small.lm_head.weight = small.embed.weight
    small.layers = torch.nn.ModuleList(_sharing_copy(layer) for layer in model.layers[:a.num_layers])
    small.rope = Rope(a, max_len)
    if small.local_rope is not None:
        small.local_rope = Rope(_local_rope_args(a), max_len)
    return small


def _sharing_copy(m: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``m`` whose parameters are new Parameter objects around the same tensors: casting the copy
    (``.to``, which assigns ``param.data``) or swapping its layers leaves ``m`` as it is."""
    c = copy.copy(m)
    c._parameters = {n: None if p is None else torch.nn.Parameter(p.data, requires_grad=False)
                     for n, p in m._parameters.items()}
    c._buffers = dict(m._buffers)
    c._modules = {n: None if s is None else _sharing_copy(s) for n, s in m._modules.items()}
    return c


def _measure_dtype(cfg: EngineConfig, model: Llama, resolved, device: torch.device, dtype_name: str) -> dict:
    """T(rows) for ``model.dtype: auto``: the target's first layers (``measurement_model``) in ``dtype_name``, plain
    decoding, one slot, after up to 300 cached tokens (fewer when the configured context is shorter)."""
    from server.engine.engine import Engine  # the measurement runs the batched step on the copy

    rows = AUTO_ROWS if cfg.cache.max_seq_len >= 1 + max(AUTO_ROWS) + 1 else (1,)
    cached = max(1, min(300, cfg.cache.max_seq_len - max(rows) - 1))
    c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype_name),
                            cache=dataclasses.replace(cfg.cache, num_slots=1, max_seq_len=cached + max(rows) + 1),
                            drafter=dataclasses.replace(cfg.drafter, name="none"))
    small = measurement_model(model, c.cache.max_seq_len)
    target = _build_target(small, resolved, device, dtype_name, cfg.model.quantization)
    return step_curve(Engine(c, target=target), rows, cached=cached, repeats=5)
