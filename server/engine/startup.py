"""Start-up: the target loaded from the config, in the dtype and kernels measured fastest on this machine, and the
engine on it.

Loading sits above the engine because choosing the serving dtype runs the engine's batched step:
``model.dtype: auto`` times a few of the target's layers in each candidate dtype (``stepcost.choose_dtype``) before
the whole model is cast, and the int4 matmul form and the linear kernels are measured once per machine as the
weights are quantized (``stepcost.choose_int4_form``, ``tune_linear``). Every choice is remembered beside the weights.
"""
from __future__ import annotations

import copy
import ctypes
import dataclasses
import logging

import torch

from core.ops import DTYPES, Int4Weight, LlamaArgs, Rope
from drafters.base import Drafter
from server.config import EngineConfig
from server.engine.engine import Engine
from server.engine.model import Llama, _local_rope_args
from server.engine.quant import kernel_path, quantize_model, resolve_quantization
from server.engine.stepcost import AUTO_ROWS, choose_dtype, choose_int4_form, step_curve, tune_linear
from server.engine.target import Target, resolve_device
from server.engine.weights import load_weights
from server.model_files import load_hf_config, resolve_model

log = logging.getLogger(__name__)


def load_engine(cfg: EngineConfig, drafter: Drafter | None = None, progress: bool = True) -> Engine:
    """The target loaded from ``cfg`` and an engine on it (with ``drafter``, else the config's)."""
    return Engine(cfg, drafter, load_target(cfg, progress=progress))


def load_target(cfg: EngineConfig, progress: bool = True) -> Target:
    """Build the target model from the config (a GGUF source's metadata read once into the cache, its weights from
    the file).

    ``model.dtype: auto`` measures the candidate dtypes on this machine first (``server.engine.stepcost``); any other
    dtype is the one a GGUF file's tensors are de-quantized into, one at a time (no float32 copy of the model).
    """
    resolved = resolve_model(cfg.model.source, cfg.model.cache_dir, progress=progress)
    gguf = resolved.gguf_file
    args = LlamaArgs.from_hf(load_hf_config(resolved.hf_dir))
    args.check_context(cfg.cache.max_seq_len)
    device = resolve_device(cfg.model.device)
    quantization = resolve_quantization(cfg.model.quantization, device, gguf)
    if quantization != cfg.model.quantization:
        log.info("model.quantization auto: %s (%s kernels on %s)", quantization,
                 kernel_path(quantization, device), device)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, quantization=quantization))
    name = cfg.model.dtype
    if name == "auto" and kernel_path(cfg.model.quantization, device) == "qlinear":
        name = "float32"  # the kernel quantizes activations to int8 itself: 16-bit ones would only add casts
        log.info("model.dtype auto: float32 (quantization %s on the qlinear kernel)", cfg.model.quantization)
    with torch.device("meta"):  # skip random init: every weight is loaded below
        model = Llama(args, cfg.cache.max_seq_len)
    load_dtype = DTYPES[name] if name != "auto" else torch.float32
    model.load_hf_state_dict(load_weights(resolved.hf_dir, gguf, load_dtype))
    model.eval().requires_grad_(False)
    if name == "auto":
        name = choose_dtype(lambda d: measure_dtype(cfg, model, resolved, device, d), device,
                            cfg.model.quantization, resolved.hf_dir)
    target = build_target(model, resolved, device, name, cfg.model.quantization)
    target.quantization = cfg.model.quantization
    release_freed_memory()
    return target


def release_freed_memory() -> None:
    """Hand the memory loading freed (de-quantized float32 tensors, pre-fusion matrices) back to the system: glibc
    keeps freed blocks under its mmap threshold in the heap, ~125 MiB for the embedded model. A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build_target(model: Llama, resolved, device: torch.device, dtype_name: str, quantization: str) -> Target:
    dtype = DTYPES[dtype_name]
    model = model.to(device=device, dtype=dtype)
    form = "packed"
    if quantization == "int4" and kernel_path(quantization, device) == "aten" and device.type == "cpu":
        form = choose_int4_form(widest_matrix(model), dtype, resolved.hf_dir)
    kernels = quantize_model(model, quantization, dtype, gguf=resolved.gguf_file, int4_form=form)
    if quantization != "none":
        log.info("quantization %s on %s (%s kernels%s)", quantization, device, kernels,
                 ", int4 as dense matrices: the packed kernel measured slower here" if form == "dense" else "")
    dense = [w.dense if isinstance(w, Int4Weight) and w.dense is not None else w for w in model.matmul_weights()]
    tune_linear([w for w in dense if isinstance(w, torch.Tensor)], resolved.hf_dir)
    return Target(model, resolved.model_id, device, dtype, resolved.hf_dir, resolved.gguf)


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


def measure_dtype(cfg: EngineConfig, model: Llama, resolved, device: torch.device, dtype_name: str) -> dict:
    """T(rows) for ``model.dtype: auto``: the target's first layers (``measurement_model``) in ``dtype_name``, plain
    decoding, one slot, after up to 300 cached tokens (fewer when the configured context is shorter)."""
    rows = AUTO_ROWS if cfg.cache.max_seq_len >= 1 + max(AUTO_ROWS) + 1 else (1,)
    cached = max(1, min(300, cfg.cache.max_seq_len - max(rows) - 1))
    c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype_name),
                            cache=dataclasses.replace(cfg.cache, num_slots=1, max_seq_len=cached + max(rows) + 1),
                            drafter=dataclasses.replace(cfg.drafter, name="none"))
    small = measurement_model(model, c.cache.max_seq_len)
    target = build_target(small, resolved, device, dtype_name, cfg.model.quantization)
    return step_curve(Engine(c, target=target), rows, cached=cached, repeats=5)
