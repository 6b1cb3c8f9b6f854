"""Every trained drafter artefact on disk: one safetensors file holding the weights and, in its metadata under one
key, the JSON of the model's config dataclass; the card (data, recipe, measurements) sits next to it as JSON.
Shipped files live under ``checkpoints/<target id>/<name>.safetensors`` (``default_path``).

GLIDE, Falcon and the acceptance heads each name their metadata key, config class and error class, so a file of one
kind is refused by another's loader ("not a ... checkpoint"); GLIDE and Falcon share the whole load path
(``load_drafter_model``: read, check it fits the target, place it on the target's device and dtype).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("specserve.engine")

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"


def default_path(target_id: str, name: str) -> Path:
    """Where the shipped artefact ``name`` (glide, falcon, accept-glide, bigram, ...) of a target lives."""
    return CHECKPOINT_DIR / target_id / f"{name}.safetensors"


def write_card(path: Path, card: dict | None) -> None:
    """The card of the artefact at ``path``, as JSON next to it (nothing when ``card`` is None)."""
    if card is not None:
        Path(path).with_suffix(".json").write_text(json.dumps(card, indent=2) + "\n")


def save_checkpoint(path: Path, state: dict[str, torch.Tensor], key: str, config, card: dict | None = None,
                    dtype: torch.dtype | None = None, skip: Callable[[str], bool] = lambda name: False) -> None:
    """Write ``state`` (floating tensors cast to ``dtype`` when given; names ``skip`` accepts left out) with
    ``asdict(config)`` under metadata ``key``; ``card`` goes to ``path`` with the suffix ``.json``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
               for name, v in state.items() if not skip(name)}
    save_file(tensors, str(path), metadata={key: json.dumps(asdict(config))})
    write_card(path, card)


def read_checkpoint(path: Path, key: str, error: type[Exception], what: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config fields, tensors) of a file written by ``save_checkpoint`` under ``key``; ``error`` when the file is
    missing or holds no ``key`` metadata (``what`` names the kind in the message)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise error(f"no {what} at {path}")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if key not in meta:
        raise error(f"{path} is not {'an' if what[0] in 'aeiou' else 'a'} {what} (no {key} metadata)")
    return json.loads(meta[key]), load_file(str(path))


def read_model(model_cls, config_cls, path: Path, key: str, error: type[Exception], what: str):
    """A drafter model (float32) from a file written by ``save_checkpoint`` under ``key``: its config, its kept
    vocabulary's size from the file, its weights (RoPE tables are rebuilt, not stored); ``error`` on any mismatch."""
    config, state = read_checkpoint(path, key, error, what)
    model = model_cls(config_cls(**config))
    model.vocab_ids = torch.empty_like(state["vocab_ids"])  # the subset size comes from the file
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rope.")]
    if missing or unexpected:
        raise error(f"{path}: weight mismatch: missing={missing} unexpected={unexpected}")
    return model.float()


def check_target(path: Path, error: type[Exception], how: str, trained_for: str, target_id: str,
                 shapes: str, got: tuple, want: tuple) -> None:
    """Fail clearly when a checkpoint was trained for another target: another id, or other shapes (``shapes`` names
    the tuple's fields)."""
    if trained_for != target_id:
        raise error(f"{path} was trained for target {trained_for!r}, not {target_id!r}; {how}")
    if want != got:
        raise error(f"{path} expects target shapes ({shapes}) = {got}, the target has {want}; {how}")


def load_drafter_model(target, load: Callable[[Path], object], check: Callable, path: Path, default: Path,
                       error: type[Exception], what: str, command: str, weights: str = "auto"):
    """A learned drafter's model for ``target``, on its device and dtype, attached to its embedding and LM head:
    ``load(path)`` reads it, ``check(config, target_args, target_id, path)`` refuses another target's file;
    ``weights`` picks its matrices (``drafter_weights``)."""
    if not path.is_file():
        raise error(f"no {what} for target {target.model_id!r} at {path}; train one with `specserve {command} "
                    f"--config <your config>` (it writes {default}) or set the drafter's `checkpoint` option")
    model = load(path)
    check(model.c, target.args, target.model_id, path)
    model = model.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    return drafter_weights(model.attach(target.embed_weight, target.lm_head_weight), target, weights)


DRAFTER_WEIGHTS = ("auto", "int8", "dense")
_MEASURED: dict[tuple, dict[str, float]] = {}  # (matrix shapes, dtype) -> {"dense": ms, "int8": ms}, per process


def check_weights(weights: str) -> None:
    if weights not in DRAFTER_WEIGHTS:
        raise ValueError(f"drafter option weights: {weights!r} is not one of {', '.join(DRAFTER_WEIGHTS)}")


def drafter_weights(model, target, weights: str = "auto"):
    """The learned drafter's matrices, by the drafter option ``weights``:

    - ``int8``: each 2-D parameter whose input width is a multiple of 32, and its LM-head rows, become int8 per block
      of 32 (``specserve_kernels.cpu.BlockQuantWeight``), which ``core.ops.linear`` multiplies with the CPU kernel the
      quantized targets run. A drafter forward then reads half its bfloat16 bytes (a quarter of float32's).
    - ``dense``: the target's dtype, as the checkpoint was trained.
    - ``auto`` (default): int8 where the target itself runs that kernel (a float32 target on the qlinear path);
      elsewhere on a CPU where the kernel loads, int8 if one pass over the drafter's matrices measured faster so
      (``measure_weights``, once per process and shape), else dense; dense on GPUs.

    Drafts only propose (the target verifies every token), so this changes acceptance, never the output."""
    check_weights(weights)
    from specserve_kernels import cpu

    matrices = _int8_matrices(model)
    if weights == "dense" or not matrices:
        return model
    usable = target.device.type == "cpu" and cpu.load() is not None
    if weights == "int8" and not usable:
        raise ValueError(f"drafter option weights: int8 needs the CPU kernel ({cpu.unavailable_reason()}); this "
                         f"target runs on {target.device.type}")
    if weights == "auto":
        if not usable:
            return model
        on_target_path = getattr(target, "kernels", "aten") == "qlinear" and target.dtype == torch.float32
        if not on_target_path:
            ms = measure_weights(model)
            if ms["int8"] >= ms["dense"]:
                return model
    for owner, name, w in matrices:
        owner._parameters.pop(name, None)  # a parameter (the head's rows are a plain attribute)
        setattr(owner, name, cpu.BlockQuantWeight.quantize(w, 8))
    return model


def _int8_matrices(model) -> list[tuple]:
    """(owner, attribute, matrix) of every dense matrix the int8 kernel can take (input width a multiple of 32): the
    2-D parameters, then the LM-head rows."""
    from specserve_kernels.cpu import QK

    found = [(module, name, p.detach()) for module in model.modules()
             for name, p in module.named_parameters(recurse=False) if p.dim() == 2 and p.shape[1] % QK == 0]
    head = model.head_weight
    if isinstance(head, torch.Tensor) and head.shape[1] % QK == 0:
        found.append((model, "head_weight", head))
    return found


def measure_weights(model, rows: int = 2, repeats: int = 7) -> dict[str, float]:
    """Median ms of one pass over the drafter's matrices (those ``drafter_weights`` would swap: ``_int8_matrices``)
    at ``rows`` rows (a Falcon block; a GLIDE step runs one), dense against int8 blocks, interleaved so both see the
    same moments of a busy machine. Remembered per process by the matrices' shapes and dtype."""
    import statistics
    import time

    from core.ops import linear
    from specserve_kernels.cpu import BlockQuantWeight

    dense = [w for _, _, w in _int8_matrices(model)]
    key = (tuple(tuple(w.shape) for w in dense), str(dense[0].dtype))
    if key not in _MEASURED:
        packed = [BlockQuantWeight.quantize(w, 8) for w in dense]
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(rows, w.shape[1], generator=g).to(w.dtype) for w in dense]

        def one_pass(ws) -> float:
            t0 = time.perf_counter()
            for x, w in zip(xs, ws):
                linear(x, w)
            return time.perf_counter() - t0

        one_pass(dense), one_pass(packed)  # first calls pay one-off costs
        times = {"dense": [], "int8": []}
        for _ in range(repeats):
            times["dense"].append(one_pass(dense))
            times["int8"].append(one_pass(packed))
        _MEASURED[key] = {k: round(1e3 * statistics.median(v), 4) for k, v in times.items()}
        log.info("drafter matrices %s: dense %.3f ms, int8 %.3f ms per pass", key[1], _MEASURED[key]["dense"],
                 _MEASURED[key]["int8"])
    return _MEASURED[key]
