"""Every trained drafter artefact on disk: one safetensors file holding the weights and, in its metadata under one
key, the JSON of the model's config dataclass; the card (data, recipe, measurements) sits next to it as JSON.
Shipped files live under ``checkpoints/<target id>/<name>.safetensors`` (``default_path``).

GLIDE, Falcon and the acceptance heads each name their metadata key, config class and error class, so a file of one
kind is refused by another's loader ("not a ... checkpoint"); GLIDE and Falcon share the whole load path
(``load_drafter_model``: read, check it fits the target, place it on the target's device and dtype).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

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
                       error: type[Exception], what: str, command: str):
    """A learned drafter's model for ``target``, on its device and dtype, attached to its embedding and LM head:
    ``load(path)`` reads it, ``check(config, target_args, target_id, path)`` refuses another target's file."""
    if not path.is_file():
        raise error(f"no {what} for target {target.model_id!r} at {path}; train one with `specserve {command} "
                    f"--config <your config>` (it writes {default}) or set the drafter's `checkpoint` option")
    model = load(path)
    check(model.c, target.args, target.model_id, path)
    model = model.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    return on_target_kernels(model.attach(target.embed_weight, target.lm_head_weight), target)


def on_target_kernels(model, target):
    """Where the target runs the CPU block-quantized kernel (a float32 target on ``kernels.cpu``'s qlinear path), the
    drafter's matrices run it too: each 2-D parameter whose input width is a multiple of 32, and its LM-head rows,
    become int8 per block of 32 (``BlockQuantWeight``), which ``core.ops.linear`` multiplies with the same kernel.
    A drafter forward then reads a quarter of its float32 bytes, so its cost keeps pace with the target's step.
    Drafts only propose (the target verifies every token), so this changes acceptance, never the output."""
    if getattr(target, "kernels", "aten") != "qlinear" or target.dtype != torch.float32:
        return model
    from kernels.cpu import QK, BlockQuantWeight

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 2 and p.shape[1] % QK == 0:
                del module._parameters[name]
                setattr(module, name, BlockQuantWeight.quantize(p.detach(), 8))
    if isinstance(model.head_weight, torch.Tensor):
        model.head_weight = BlockQuantWeight.quantize(model.head_weight, 8)
    return model
