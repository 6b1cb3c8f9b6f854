"""Checkpoint files of the learned drafters: one safetensors file holding the weights and, in its metadata under one
key, the JSON of the model's config dataclass; the card (data, recipe, measurements) sits next to it as JSON.

GLIDE, Falcon and the acceptance heads each wrap these two functions with their own config class, error class and
weight checks, so a file of one kind is refused by another's loader ("not a ... checkpoint").
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"


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
    if card is not None:
        path.with_suffix(".json").write_text(json.dumps(card, indent=2) + "\n")


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
