"""What every trainer shares: stable hashes, the validation split by prompt hash, prompt-source groups, the kept
vocabulary, the learning-rate schedule, the optimizer and its resumable state. Where the work lives:
``training.paths``; a run's set-up: ``training.run``."""
from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


# -- stable hashes ------------------------------------------------------------------------------------------------
def stable_int(*parts: Any) -> int:
    """A 62-bit integer from ``parts``, the same in every process (Python's ``hash`` of a str is salted per run)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def stable_unit(*parts: Any) -> float:
    """A float in [0, 1) from ``parts``, the same in every process."""
    return stable_int(*parts) / 2**62


def answers_digest(items: list[dict]) -> str:
    """12 hex digits naming a list of answers by content (prompt and answer ids), for the teacher-pass files: another
    data set of the same size is not it."""
    ids = repr([(i["prompt_ids"], i["response_ids"]) for i in items])
    return hashlib.blake2b(ids.encode(), digest_size=6).hexdigest()


# -- data: sources, validation split, vocabulary ------------------------------------------------------------------
def is_shipped_text(item: dict) -> bool:
    """A sequence of shipped text (``training/text.py``), not an answer of the target."""
    return str(item.get("source", "")).startswith("text:")


def source_group(item: dict) -> str:
    """The name a validation sequence is reported under: its prompt source, shipped text as one group."""
    return "text" if is_shipped_text(item) else str(item.get("source", "")) or "answers"


def data_sources(items: list[dict]) -> dict[str, int]:
    """Answers per prompt source (`chat`, `humaneval`, `synth`, ...), the target's turns inside synthesized
    conversations counted apart: what a checkpoint's card says it learned from."""
    return dict(sorted(Counter(i.get("source", "") + ("-conversation" if "turn" in i else "") for i in items).items()))


def cap_sources(items: list[dict], caps: dict[str, int], seed: int) -> list[dict]:
    """``items`` with each source named in ``caps`` cut to a seeded subset of about that many answer tokens (held-out
    and trained alike, so a teacher pass reads only what trains or validates), the others whole; in their order."""
    if not caps:
        return items
    keep, used = set(), Counter()
    for n in sorted(range(len(items)), key=lambda n: stable_int(seed, "cap", items[n]["prompt_ids"],
                                                                 items[n]["response_ids"][:8])):
        src = str(items[n].get("source", ""))
        if src not in caps:
            keep.add(n)
        elif used[src] < caps[src]:
            keep.add(n)
            used[src] += len(items[n]["response_ids"])
    return [it for n, it in enumerate(items) if n in keep]


def seeded_split(n: int, val_fraction: float, rng: random.Random) -> tuple[list[int], list[int]]:
    """(train, validation) of n sequences when no split is given: a ``val_fraction`` drawn with ``rng``."""
    order = list(range(n))
    rng.shuffle(order)
    n_val = max(1, int(n * val_fraction)) if n > 1 else 0
    return order[n_val:] or order, order[:n_val]


def held_out(prompt_ids, seed: int, val_fraction: float) -> bool:
    """Whether a sequence is in the validation set: by a hash of its prompt, so every drafter's training (GLIDE,
    Falcon) holds out the same prompts whatever subset or weighting it trains on."""
    return stable_unit("glide-val", seed, list(prompt_ids)) < val_fraction


def vocab_by_frequency(items: list[dict], vocab_size: int, keep: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``keep`` most frequent answer tokens (ties by id), plus ``always`` (stop tokens), sorted by frequency."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for it in items:
        counts += torch.bincount(torch.tensor(it["response_ids"], dtype=torch.long), minlength=vocab_size)
    for t in always:
        counts[t] = counts.max() + 1
    if keep <= 0 or keep >= vocab_size:
        return torch.arange(vocab_size)
    return torch.sort(torch.argsort(-counts, stable=True)[:keep]).values


def coverage(items: list[dict], vocab_ids: torch.Tensor, vocab_size: int) -> float:
    kept = torch.zeros(vocab_size, dtype=torch.bool)
    kept[vocab_ids] = True
    total = sum(len(it["response_ids"]) for it in items)
    hit = sum(int(kept[torch.tensor(it["response_ids"])].sum()) for it in items)
    return hit / max(1, total)


# -- optimisation -------------------------------------------------------------------------------------------------
@dataclass
class TrainerOptions:
    """The recipe every drafter trainer shares; each trainer's options add their own fields."""

    steps: int = 1200
    batch_tokens: int = 4096       # loss positions per optimizer step (whole sequences)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_len: int = 768             # training sequences are cut to this many tokens
    val_fraction: float = 0.05
    save_every: int = 100
    seed: int = 0
    autocast: bool = True          # bfloat16 autocast for the matmuls (AMX on CPU, tensor cores on GPU)


def lr_at(step: int, opts) -> float:
    """Linear warm-up over ``opts.warmup`` steps, then cosine decay to ``opts.min_lr_ratio`` of ``opts.lr``."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    t = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.lr * (opts.min_lr_ratio + (1 - opts.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def make_optimizer(model: torch.nn.Module, opts) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """(trainable parameters, AdamW): weight decay on matrices only, betas (0.9, 0.95)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": opts.weight_decay},
                               {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                              lr=opts.lr, betas=(0.9, 0.95))
    return params, optim


def resume(state_path: Path | None, model, optim, rng: random.Random, log=print) -> tuple[int, list]:
    """(step, history) of a run's saved state, loaded into ``model``, ``optim`` and ``rng``; (0, []) without one."""
    if state_path is None or not Path(state_path).exists():
        return 0, []
    st = torch.load(state_path, weights_only=False)
    model.load_state_dict(st["model"], strict=False)
    optim.load_state_dict(st["optim"])
    rng.setstate(st["rng"])
    log(f"resumed from {state_path} at step {st['step']}")
    return st["step"], st["history"]


def save_state(state_path: Path | None, model, optim, step: int, history: list, rng: random.Random) -> None:
    """Write the resumable state atomically (nothing without a path)."""
    if state_path is None:
        return
    tmp = Path(state_path).with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step, "history": history,
                "rng": rng.getstate()}, tmp)
    tmp.replace(state_path)


def start_from(load, check_fits, path: Path, target, log=print) -> tuple[Any, dict]:
    """A drafter checkpoint to continue training (``--init``): loaded with ``load``, checked against the target with
    ``check_fits``, on the target's device and attached to its embedding and LM head; with the card entry naming it
    (file and digest), which the run's recipe key and card carry."""
    from drafters.adaptive import checkpoint_digest

    path = Path(path)
    model = load(path)
    check_fits(model.c, target.args, target.model_id, path)
    model = model.to(target.device)
    model.attach(target.embed_weight.float(), target.lm_head_weight.float())
    log(f"starting from {path} (kept vocabulary {len(model.vocab_ids)})")
    return model, {"file": path.name, "digest": checkpoint_digest(path)}
