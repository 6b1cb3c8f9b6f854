"""Where a target's training work lives: its work directory, the answers, the answer sets and their shards, the
synthesized prompts; and how a file there is written (atomically)."""
from __future__ import annotations

import re
from pathlib import Path

import torch


def work_dir(cfg, model_id: str) -> Path:
    """``<cache>/train/<target id>``: answers, teacher passes, resumable train states."""
    from server.model_files import default_cache_dir

    return Path(cfg.model.cache_dir or default_cache_dir()) / "train" / model_id


def answers_path(cfg, model_id: str) -> Path:
    """Where ``train data`` writes the target's answers, and where every trainer reads them by default."""
    return work_dir(cfg, model_id) / "responses.pt"


SET_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")


def answer_set_path(cfg, model_id: str, name: str) -> Path:
    """Where ``train data --set NAME`` writes the answers to a prompt source of its own: its prompts are numbered from
    0 and sharded apart from the main set's, so neither set's growth moves the other's shards."""
    if not SET_NAME.fullmatch(name):
        raise ValueError(f"an answer set's name is 1-40 lower-case letters, digits, '-' or '_', got {name!r}")
    return work_dir(cfg, model_id) / "responses.sets" / f"{name}.pt"


def answer_set_names(cfg, model_id: str) -> list[str]:
    """The answer sets the work directory holds, complete (a merged ``NAME.pt``) or not (shards only), by name."""
    found = (p.name.removesuffix(".shards").removesuffix(".pt")
             for p in (work_dir(cfg, model_id) / "responses.sets").glob("*") if p.suffix in (".pt", ".shards"))
    return sorted({n for n in found if SET_NAME.fullmatch(n)})


def synth_dir(cfg, model_id: str) -> Path:
    """Where ``train prompts`` writes the synthesized prompts of a target."""
    return work_dir(cfg, model_id) / "synth"


def shard_dir(out: Path) -> Path:
    """Where ``out``'s shards live: ``responses.pt`` -> ``responses.shards/``."""
    return out.with_name(out.stem + ".shards")


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then renamed over it: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)
