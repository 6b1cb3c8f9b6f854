"""Build the Max-Gram drafter's bigram table for a target: ``specserve train bigram``.

Counts token bigrams over the self-distilled training data (each prompt followed by the target's own answer,
training/data.py; generated first when missing) and keeps, for every vocabulary entry, its most frequent next
token (ties: the smaller id). A token never seen with a successor maps to the most frequent token of the data
overall (as a successor), the best guess without context. Output: ``bigram.safetensors`` (int32 [V]) + a JSON card
next to it, by default under drafters/checkpoints/<target id>/.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def count_bigrams(sequences: list[list[int]], vocab_size: int) -> tuple[torch.Tensor, dict]:
    """-> (table [V] int32, stats). table[v] = the most frequent token following v in ``sequences``."""
    firsts, seconds = [], []
    for seq in sequences:
        ids = np.asarray(seq, dtype=np.int64)
        if len(ids) >= 2:
            firsts.append(ids[:-1])
            seconds.append(ids[1:])
    if not firsts:
        raise ValueError("no bigrams: every sequence is shorter than two tokens")
    prev, nxt = np.concatenate(firsts), np.concatenate(seconds)
    if min(prev.min(), nxt.min()) < 0 or max(prev.max(), nxt.max()) >= vocab_size:
        raise ValueError(f"token ids outside the vocabulary [0, {vocab_size})")
    pairs, counts = np.unique(prev * vocab_size + nxt, return_counts=True)
    p, q = pairs // vocab_size, pairs % vocab_size
    order = np.lexsort((q, -counts, p))  # by previous token, then most frequent, then smallest next id
    p, q = p[order], q[order]
    first = np.ones(len(p), dtype=bool)
    first[1:] = p[1:] != p[:-1]
    fallback = int(np.bincount(nxt, minlength=vocab_size).argmax())
    table = np.full(vocab_size, fallback, dtype=np.int64)
    table[p[first]] = q[first]
    stats = {"bigrams": int(len(prev)), "distinct_bigrams": int(len(pairs)),
             "tokens_with_successor": int(first.sum()), "fallback_token": fallback}
    return torch.from_numpy(table).to(torch.int32), stats


def run_train_bigram(cfg, out: Path | None = None, data_path: Path | None = None, max_new_tokens: int = 256,
                     gen_batch: int = 32, limit: int | None = None, progress: bool = True, log=print) -> Path:
    """Data (generated when missing) -> bigram counts -> table + card. Returns the table's path."""
    from drafters.cascade.maxgram import default_bigram_path, save_bigram
    from training.data import ensure_data
    from server.engine import load_target

    target = load_target(cfg, progress=progress)
    data_file, items = ensure_data(cfg, target, data_path, max_new_tokens, gen_batch, limit, progress, log)
    seqs = [list(it["prompt_ids"]) + list(it["response_ids"]) for it in items]
    table, stats = count_bigrams(seqs, target.args.vocab_size)
    out = Path(out) if out else default_bigram_path(target.model_id)
    card = {"target": target.model_id, "drafter": "maxgram bigram table",
            "format": "safetensors `next_token` int32 [vocab]: the most frequent next token of each token id",
            "data": {"file": data_file.name, "sequences": len(items),
                     "tokens": sum(len(s) for s in seqs),
                     "text": "training prompts followed by the target's own greedy answers "
                             "(training/prompts.py, training/data.py)"},
            "counts": stats,
            "unseen_tokens": "map to fallback_token, the most frequent successor overall"}
    save_bigram(out, table, target.model_id, card)
    log(f"{stats['bigrams']} bigrams over {len(items)} sequences; {stats['tokens_with_successor']} of "
        f"{target.args.vocab_size} tokens seen with a successor; wrote {out} and {out.with_suffix('.json')}")
    return out
