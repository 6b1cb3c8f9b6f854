"""The teacher pass: one forward of the target per training sequence (prompt + answer), through the engine's public
``Target.forward``, keeping what a drafter learns from: the K/V of the target layers GLIDE reads and the target's
final-normed hidden states (at the answer positions for GLIDE and the acceptance heads, at every position for
Falcon's features). ``cached_teacher`` keeps GLIDE's passes on disk by content, so more answers, a subset of them or a
killed run compute only what is new. ``padded_pass`` is Falcon's pass on a GPU: padded batches through the Hugging
Face model of the same weights, which a GPU runs several times faster than the engine's packed forwards."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm


BATCH_TOKENS_CUDA = 32768  # rows per packed teacher forward on a GPU (``teacher_pass``)


@dataclass
class TeacherData:
    """Flat per-sequence tensors."""

    tokens: list[torch.Tensor]      # per sequence [T] long
    answer_start: list[int]         # first position whose next token is an answer token (prompt_len - 1)
    kv: list[torch.Tensor]          # per sequence [n_read, 2, H_kv, T, D] (bf16/fp16), or empty when no layer is read
    hidden: list[torch.Tensor]      # per sequence final-normed target states: [T - 1 - answer_start, hidden] at the
                                    # answer positions, or [T, hidden] with ``all_positions``
    index: list[int] = field(default_factory=list)  # per sequence: its position in the items the pass read
    taps: list[torch.Tensor] = field(default_factory=list)  # per sequence [T, n_taps, hidden] (``taps`` given)

    def __len__(self) -> int:
        return len(self.tokens)


def kept_sequences(items: list[dict], max_len: int, min_answer: int) -> list[tuple[int, list[int], int]]:
    """(item index, prompt + answer cut to ``max_len``, answer start) for the items with at least ``min_answer``
    answer positions left: the sequences a teacher pass runs, in the items' order."""
    out = []
    for n, it in enumerate(items):
        ids = (list(it["prompt_ids"]) + list(it["response_ids"]))[:max_len]
        start = len(it["prompt_ids"]) - 1
        if len(ids) - 1 - start >= min_answer:
            out.append((n, ids, start))
    return out


@torch.inference_mode()
def teacher_pass(target, items: list[dict], read_layers: list[int], max_len: int, store_dtype=torch.bfloat16,
                 progress: bool = True, all_positions: bool = False, min_answer: int = 1,
                 taps: tuple[int, ...] = (), batch_tokens: int | None = None) -> TeacherData:
    """One target forward per sequence (prompt + answer, cut to ``max_len``); a sequence with fewer than
    ``min_answer`` answer positions left is skipped (``index`` says which were kept). ``taps``: also keep the residual
    stream after those layer counts, at every position. ``batch_tokens``: sequences are packed into forwards of up to
    that many rows (``Target.forward_many``); None packs on CUDA, where one short forward per sequence leaves the
    GPU idle between kernel launches, and runs one sequence per forward elsewhere."""
    if batch_tokens is None:
        batch_tokens = BATCH_TOKENS_CUDA if target.device.type == "cuda" else 0
    out = TeacherData([], [], [], [], [])
    todo = kept_sequences(items, max_len, min_answer)
    bar = tqdm(total=len(items), desc="teacher pass", unit="seq", disable=not progress)
    i = 0
    while i < len(todo):
        j, rows = i + 1, len(todo[i][1])
        while j < len(todo) and rows + len(todo[j][1]) <= batch_tokens:
            rows += len(todo[j][1])
            j += 1
        group = todo[i:j]
        for (n, ids, start), tp in zip(group, target.forward_many([x for _, x, _ in group], taps)):
            T = len(ids)
            normed = target.final_norm(tp.hidden if all_positions else tp.hidden[start:T - 1])
            out.tokens.append(torch.tensor(ids, dtype=torch.long))
            out.answer_start.append(start)
            out.kv.append(torch.stack([torch.stack([tp.k[layer], tp.v[layer]]) for layer in read_layers])
                          .to("cpu", store_dtype).clone() if read_layers else torch.empty(0))
            out.hidden.append(normed.to("cpu", store_dtype).clone())
            out.index.append(n)
            if taps:
                out.taps.append(tp.taps.to("cpu", store_dtype).clone())
        bar.update(group[-1][0] + 1 - bar.n)
        i = j
    bar.update(len(items) - bar.n)
    bar.close()
    return out


PADDED_ROWS = 262144  # padded rows (sequences x longest) per forward of ``padded_pass``


@torch.inference_mode()
def padded_pass(target, items: list[dict], max_len: int, min_answer: int = 1, taps: tuple[int, ...] = (),
                rows: int = PADDED_ROWS, model=None, store_dtype=torch.bfloat16) -> TeacherData:
    """``teacher_pass(..., all_positions=True)`` without K/V, run as padded batches of similar lengths through the
    Hugging Face model of the target's weights (``server.model_files.hf_causal_lm``, in the target's dtype and on its device, or
    ``model``): its final norm gives the features and its decoder layers' outputs the lower layers ``taps``.
    On a GPU a padded batch keeps thousands of sequences in one forward at the cost of plain attention, where the
    engine's packed forward pays attention over the whole pack: 21 s for 25,816 sequences (7.1M tokens) on one H200,
    against about 115 s at the engine pass's pace measured there earlier (2.6 s per 600 sequences). The outputs stay
    on the target's device."""
    if model is None:
        from server.model_files import hf_causal_lm

        model = hf_causal_lm(target.hf_dir, target.gguf, target.dtype).to(target.device).eval()
    dev = next(model.parameters()).device
    grab: dict = {}

    def keep(name):
        def hook(_mod, _inp, out):
            grab[name] = out[0] if isinstance(out, tuple) else out
        return hook

    hooks = [model.model.layers[n - 1].register_forward_hook(keep(n)) for n in taps]
    hooks.append(model.model.norm.register_forward_hook(keep("final")))
    todo = kept_sequences(items, max_len, min_answer)
    order = sorted(range(len(todo)), key=lambda j: len(todo[j][1]))
    hidden: dict[int, torch.Tensor] = {}
    lower: dict[int, torch.Tensor] = {}
    try:
        i = 0
        while i < len(order):
            j = i + 1  # sorted by length: the last sequence of a batch is its longest
            while j < len(order) and (j + 1 - i) * len(todo[order[j]][1]) <= rows:
                j += 1
            batch = order[i:j]
            width = len(todo[batch[-1]][1])
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, b in enumerate(batch):
                ids[r, :len(todo[b][1])] = torch.tensor(todo[b][1])
                mask[r, :len(todo[b][1])] = 1
            model(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False, logits_to_keep=1)
            for r, b in enumerate(batch):
                T = len(todo[b][1])
                hidden[b] = grab["final"][r, :T].to(store_dtype).clone()
                if taps:
                    lower[b] = torch.stack([grab[n][r, :T] for n in taps], 1).to(store_dtype).clone()
            i = j
    finally:
        for h in hooks:
            h.remove()
    out = TeacherData([], [], [], [], [])
    for b, (n, ids, start) in enumerate(todo):
        out.tokens.append(torch.tensor(ids, dtype=torch.long))
        out.answer_start.append(start)
        out.kv.append(torch.empty(0))
        out.hidden.append(hidden[b])
        out.index.append(n)
        if taps:
            out.taps.append(lower[b])
    return out


def usable(item: dict, max_len: int) -> bool:
    """Whether a sequence cut to ``max_len`` keeps at least one answer position (what ``teacher_pass`` keeps)."""
    return len(item["response_ids"]) >= 1 and len(item["prompt_ids"]) < max_len


def teacher_key(item: dict, max_len: int) -> str:
    """What a sequence's teacher outputs depend on besides the target and the layers read: its tokens as cut."""
    ids = (list(item["prompt_ids"]) + list(item["response_ids"]))[:max_len]
    return hashlib.blake2b(json.dumps([len(item["prompt_ids"]), ids]).encode(), digest_size=16).hexdigest()


def cached_teacher(target, items: list[dict], read_layers: list[int], max_len: int, cache: Path,
                   shard_size: int = 512, progress: bool = True, log=print) -> tuple[TeacherData, list[int]]:
    """``teacher_pass`` over the usable ``items``, cached by content in shards under ``cache`` (one directory per
    target, layers read, max_len and dtype: the caller names it). Returns the data and, per row, the item's index.

    Only sequences no shard holds are computed, in shards written as they finish: more answers, a subset of them or
    a killed run cost only what is new."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    rows = [i for i, it in enumerate(items) if usable(it, max_len)]
    keys = [teacher_key(items[i], max_len) for i in rows]
    want, found = set(keys), {}
    for f in sorted(cache.glob("shard-*.pt")):
        sh = torch.load(f, weights_only=True)
        for j, k in enumerate(sh["keys"]):
            if k in want and k not in found:
                found[k] = (sh["tokens"][j], sh["answer_start"][j], sh["kv"][j], sh["hidden"][j])
        del sh
    todo = list(dict.fromkeys(k for k in keys if k not in found))
    if found:
        log(f"teacher cache {cache}: {len(want) - len(todo)} of {len(want)} sequences cached, {len(todo)} to compute")
    first = {k: i for k, i in zip(reversed(keys), reversed(rows))}
    for a in range(0, len(todo), shard_size):
        part = todo[a:a + shard_size]
        t = teacher_pass(target, [items[first[k]] for k in part], read_layers, max_len, progress=progress)
        assert len(t) == len(part)
        _save = {"keys": part, **{f: getattr(t, f) for f in ("tokens", "answer_start", "kv", "hidden")}}
        name = hashlib.blake2b("".join(part).encode(), digest_size=8).hexdigest()
        tmp = cache / f"shard-{name}.pt.tmp"
        torch.save(_save, tmp)
        tmp.replace(cache / f"shard-{name}.pt")
        for j, k in enumerate(part):
            found[k] = (t.tokens[j], t.answer_start[j], t.kv[j], t.hidden[j])
    out = TeacherData([], [], [], [], [])
    for k in keys:
        tok, start, kv, hidden = found[k]
        out.tokens.append(tok)
        out.answer_start.append(start)
        out.kv.append(kv)
        out.hidden.append(hidden)
    return out, rows
