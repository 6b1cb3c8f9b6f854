"""What every trainer shares: stable hashes, work directories, the validation split by prompt hash, prompt-source
groups, the kept vocabulary, the learning-rate schedule, the optimizer and its resumable state, and the set-up of a
run (target, data, tokenizer, vocabulary, shipped text)."""
from __future__ import annotations

import hashlib
import math
import random
import re
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


# -- where a target's training work lives --------------------------------------------------------------------------
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


# -- a run's set-up -----------------------------------------------------------------------------------------------
@dataclass
class TrainingRun:
    """What a drafter's trainer starts from."""

    target: Any                  # server.engine.Target
    tokenizer: Any
    stops: tuple[int, ...]       # the target's stop tokens (always in the kept vocabulary)
    data_file: Path              # the answers file
    items: list[dict]            # the target's answers
    text_items: list[dict]       # shipped text sequences (``text_tokens`` of them)
    vocab_ids: torch.Tensor      # the kept vocabulary, most frequent answer tokens first
    work: Path                   # ``work_dir``, created


def prepare_run(cfg, seed: int, data_path: Path | None, max_new_tokens: int, gen_batch: int, limit: int | None,
                vocab_subset: int, text_tokens: int, progress: bool = True, log=print) -> TrainingRun:
    """Seed torch, load the target, make or read its answers (``training.data.ensure_data``), keep the vocabulary,
    add shipped text: the start of the GLIDE and Falcon trainers alike."""
    from server.engine import load_target
    from server.model_files import load_tokenizer
    from server.tokenization import stop_token_ids
    from training.data import ensure_data

    torch.manual_seed(seed)
    target = load_target(cfg, progress=progress)
    data_file, items = ensure_data(cfg, target, data_path, max_new_tokens, gen_batch, limit, progress, log)
    tokenizer = load_tokenizer(target.hf_dir)
    stops = stop_token_ids(tokenizer, target.args.eos_token_ids)
    vocab_ids = vocab_by_frequency(items, target.args.vocab_size, vocab_subset, stops)
    log(f"{len(items)} sequences, {sum(len(i['response_ids']) for i in items)} answer tokens; kept vocabulary "
        f"{len(vocab_ids)} covers {coverage(items, vocab_ids, target.args.vocab_size):.2%} of answer tokens")
    text_items = []
    if text_tokens:
        from training.text import shipped_text_items
        text_items = shipped_text_items(tokenizer, text_tokens, seed=seed)
        log(f"+ {len(text_items)} sequences ({sum(len(i['response_ids']) + 1 for i in text_items)} tokens) of "
            "shipped text")
    work = work_dir(cfg, target.model_id)
    work.mkdir(parents=True, exist_ok=True)
    return TrainingRun(target, tokenizer, stops, data_file, items, text_items, vocab_ids, work)
