"""The set-up of a drafter's training run: the target, its answers, the tokenizer, the kept vocabulary and shipped
text, the start of the GLIDE and Falcon trainers alike."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.common import coverage, vocab_by_frequency
from training.paths import work_dir


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
