"""Train a GLIDE draft model for a target: ``specserve train glide``.

Pipeline (each stage cached under ``<cache>/train/<target id>/`` so a rerun resumes):
  1. data     the target answers the training prompts (training/data.py);
  2. teacher  one target forward per training sequence stores the post-RoPE K/V of the target layers the drafter
              reads and the target's final-normed hidden states at the answer positions (its next-token
              distributions, recomputed on the fly through the frozen LM head); cached by content, so a run on more
              answers, on a subset of them (a learning curve) or after a kill computes only the sequences not seen;
  3. train    teacher forcing with the paper's block-wise cross-attention mask (a query in block i sees target K/V of
              blocks < i only, block length 5), loss = KL(target || drafter) or cross entropy on the target's tokens,
              over the drafter's kept vocabulary; AdamW with warmup and cosine decay; resumable checkpoints;
  4. export   fp16 safetensors + a JSON card (data, steps, validation agreement) under drafters/checkpoints/.
``--vanilla`` trains the same network without cross-attention (the paper's ablation).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from core.ops import rms_norm
from drafters.glide.model import GlideConfig, GlideModel, block_mask
from training.data import stable_unit


@dataclass
class TrainOptions:
    steps: int = 1200
    batch_tokens: int = 4096       # answer tokens per optimizer step (whole sequences)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    block_len: int = 5             # the paper's block length for the cross-attention mask
    loss: str = "kl"               # "kl" (to the target's distribution) or "ce" (on the target's tokens)
    max_len: int = 768             # training sequences are cut to this many tokens
    val_fraction: float = 0.05
    save_every: int = 100
    seed: int = 0
    autocast: bool = True          # bfloat16 autocast for the matmuls (AMX on CPU, tensor cores on GPU)
    train_tokens: int = 0          # > 0: train on a seeded subset of about this many answer tokens (shipped text apart)
    source_weights: tuple[tuple[str, int], ...] = ()  # (source, w): that source's answers come w times per epoch


# -- teacher pass -------------------------------------------------------------------------------------------------
@dataclass
class TeacherData:
    """Flat per-token tensors with per-sequence offsets."""

    tokens: list[torch.Tensor]      # per sequence [T] long
    answer_start: list[int]         # first position whose next token is an answer token (prompt_len - 1)
    kv: list[torch.Tensor]          # per sequence [n_read, 2, H_kv, T, D] (bf16/fp16) or empty for vanilla
    hidden: list[torch.Tensor]      # per sequence [T - 1 - answer_start, hidden] final-normed target states

    def __len__(self) -> int:
        return len(self.tokens)


@torch.inference_mode()
def teacher_pass(target, items: list[dict], read_layers: list[int], max_len: int, store_dtype=torch.bfloat16,
                 progress: bool = True) -> TeacherData:
    """One target forward per sequence (prompt + answer, cut to ``max_len``)."""
    from server.engine.backend import make_attention
    from server.engine.model import Segment

    model = target.model
    a = model.args
    dev = target.device
    k = torch.zeros(a.num_layers, a.num_kv_heads, max_len, a.head_dim, dtype=target.dtype, device=dev)
    v = torch.zeros_like(k)
    out = TeacherData([], [], [], [])
    for it in tqdm(items, desc="teacher pass", unit="seq", disable=not progress):
        ids = (list(it["prompt_ids"]) + list(it["response_ids"]))[:max_len]
        start = len(it["prompt_ids"]) - 1
        T = len(ids)
        if T - 1 - start < 1:
            continue
        tok = torch.tensor(ids, dtype=torch.long, device=dev)
        attn = make_attention(dev, 0, T, None, target.dtype, max_len)
        h = model(tok, torch.arange(T, device=dev), [Segment(0, T, k, v, 0, None, attn)])
        normed = rms_norm(h[start:T - 1], model.norm, a.rms_norm_eps)
        out.tokens.append(tok.cpu())
        out.answer_start.append(start)
        out.kv.append(torch.stack([torch.stack([k[l, :, :T], v[l, :, :T]]) for l in read_layers])
                      .to("cpu", store_dtype).clone() if read_layers else torch.empty(0))
        out.hidden.append(normed.to("cpu", store_dtype).clone())
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
        _save = {"keys": part, **t.__dict__}
        name = hashlib.blake2b("".join(part).encode(), digest_size=8).hexdigest()
        tmp = cache / f"shard-{name}.pt.tmp"
        torch.save(_save, tmp)
        tmp.replace(cache / f"shard-{name}.pt")
        for j, k in enumerate(part):
            found[k] = (t.tokens[j], t.answer_start[j], t.kv[j], t.hidden[j])
    out = TeacherData([], [], [], [])
    for k in keys:
        tok, start, kv, hidden = found[k]
        out.tokens.append(tok)
        out.answer_start.append(start)
        out.kv.append(kv)
        out.hidden.append(hidden)
    return out, rows


def is_shipped_text(item: dict) -> bool:
    """A sequence of shipped text (``training/text.py``), not an answer of the target."""
    return str(item.get("source", "")).startswith("text:")


def source_group(item: dict) -> str:
    """The name a validation sequence is reported under: its prompt source, shipped text as one group."""
    return "text" if is_shipped_text(item) else str(item.get("source", "")) or "answers"


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


def split_rows(items: list[dict], rows: list[int], opts: TrainOptions) -> tuple[list[int], list[int]]:
    """(train, validation) row lists. A sequence is held out by a hash of its prompt, so the validation set is the
    same whatever subset or weighting trains; ``train_tokens`` keeps a seeded prefix of the rest (shipped text
    always whole), and ``source_weights`` repeats a source's rows in each epoch."""
    val, train = [], []
    for r, i in enumerate(rows):
        (val if held_out(items[i]["prompt_ids"], opts.seed, opts.val_fraction) else train).append(r)
    if opts.train_tokens > 0:
        answers = [r for r in train if not is_shipped_text(items[rows[r]])]
        text = [r for r in train if r not in set(answers)]
        random.Random(opts.seed).shuffle(answers)
        kept, n = [], 0
        for r in answers:
            if n >= opts.train_tokens:
                break
            kept.append(r)
            n += len(items[rows[r]]["response_ids"])
        train = sorted(kept + text)
    weights = dict(opts.source_weights)
    train = [r for r in train for _ in range(weights.get(items[rows[r]].get("source", ""), 1))]
    return train, val


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


# -- training -----------------------------------------------------------------------------------------------------
def sequence_loss(model: GlideModel, data: TeacherData, i: int, opts: TrainOptions, head_t: torch.Tensor,
                  local: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Loss summed over the answer positions of sequence i -> (loss_sum, n_positions, [n] drafter==target argmax)."""
    c, dev = model.c, model.norm.device
    ids = data.tokens[i].to(dev)
    T, start = len(ids), data.answer_start[i]
    positions = torch.arange(T, device=dev)
    target_kv, visible = None, None
    if c.cross_attention:
        kv = data.kv[i].to(dev, torch.float32)
        target_kv = [(kv[m, 0], kv[m, 1]) for m in range(c.num_layers)]
        visible = block_mask(T, T, opts.block_len, offset).to(dev)
    h = model(ids, positions, None, 0, target_kv, visible)[start:T - 1]  # [n, hidden]
    logits = model.logits(h).float()                                    # [n, V_kept]
    with torch.no_grad():
        t_logits = data.hidden[i].to(dev, torch.float32) @ head_t                      # [n, V_kept]
    logp = F.log_softmax(logits, dim=-1)
    if opts.loss == "kl":
        t_logp = F.log_softmax(t_logits, dim=-1)
        loss = (t_logp.exp() * (t_logp - logp)).sum()
    elif opts.loss == "ce":
        labels = local[ids[start + 1:T]]  # -1 outside the kept vocabulary
        loss = F.nll_loss(logp, labels.clamp(min=0), reduction="none")[labels >= 0].sum()
    else:
        raise ValueError(f"loss must be 'kl' or 'ce', got {opts.loss!r}")
    agree = (logits.argmax(-1) == t_logits.argmax(-1)).cpu()
    return loss, T - 1 - start, agree


@torch.no_grad()
def evaluate(model: GlideModel, data: TeacherData, idx: list[int], opts: TrainOptions, head_t, local,
             groups: dict[str, list[int]] | None = None) -> dict:
    """Validation loss and top-1 agreement with the target, overall, by offset within the block (the KV delay) and
    by ``groups`` (name -> rows of ``idx``, e.g. answers vs shipped text, whose mix would otherwise hide a trend)."""
    model.eval()
    tot_loss = tot_n = 0.0
    by_pos = torch.zeros(opts.block_len)
    cnt_pos = torch.zeros(opts.block_len)
    per_row = {}
    for i in idx:
        loss, n, agree = sequence_loss(model, data, i, opts, head_t, local)
        tot_loss += float(loss)
        tot_n += n
        pos = (torch.arange(data.answer_start[i], data.answer_start[i] + n)) % opts.block_len
        by_pos.index_add_(0, pos, agree.float())
        cnt_pos.index_add_(0, pos, torch.ones(n))
        per_row[i] = (float(agree.float().sum()), n)
    model.train()
    out = {"loss": tot_loss / max(1, tot_n), "agreement": float(by_pos.sum() / cnt_pos.sum().clamp(min=1)),
           "agreement_by_delay": [round(float(x), 4) for x in (by_pos / cnt_pos.clamp(min=1))]}
    if groups:
        out["agreement_by_group"] = {
            name: round(sum(per_row[i][0] for i in rows) / max(1, sum(per_row[i][1] for i in rows)), 4)
            for name, rows in groups.items() if rows}
    return out


def loss_tables(model: GlideModel) -> tuple[torch.Tensor, torch.Tensor]:
    """(head_t [hidden, V_kept] for the target's logits over the kept vocabulary, local [V]: vocabulary id -> kept
    row or -1), the constant inputs of ``sequence_loss`` and ``evaluate``."""
    head_t = model.head_weight.float().t().contiguous()
    local = torch.full((model.c.vocab_size,), -1, dtype=torch.long, device=model.vocab_ids.device)
    local[model.vocab_ids] = torch.arange(len(model.vocab_ids), device=model.vocab_ids.device)
    return head_t, local


def lr_at(step: int, opts: TrainOptions) -> float:
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    t = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.lr * (opts.min_lr_ratio + (1 - opts.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train(model: GlideModel, data: TeacherData, opts: TrainOptions, state_path: Path | None = None,
          progress: bool = True, log=print, split: tuple[list[int], list[int]] | None = None,
          val_groups: dict[str, list[int]] | None = None) -> dict:
    """Train in place; resumes from ``state_path`` when it exists. Returns a summary for the card. ``split``:
    (train rows, repeats allowed; validation rows), else a seeded ``val_fraction`` of the rows is held out;
    ``val_groups``: validation rows by name, each group's agreement reported apart."""
    rng = random.Random(opts.seed)
    train_idx, val_idx = split if split is not None else seeded_split(len(data), opts.val_fraction, rng)
    head_t, local = loss_tables(model)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=opts.lr, betas=(0.9, 0.95))
    step, history = 0, []
    if state_path is not None and Path(state_path).exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"], strict=False)
        optim.load_state_dict(st["optim"])
        step, history = st["step"], st["history"]
        rng.setstate(st["rng"])
        log(f"resumed from {state_path} at step {step}")
    model.train()
    first = evaluate(model, data, val_idx, opts, head_t, local, val_groups) if val_idx and step == 0 else None
    if first:
        log(f"step 0: val loss {first['loss']:.4f} agreement {first['agreement']:.4f}")
        history.append({"step": 0, **first})
    cursor = []
    bar = tqdm(total=opts.steps, initial=step, desc="train glide" if model.c.cross_attention else "train vanilla",
               unit="step", disable=not progress)
    t0 = time.perf_counter()
    while step < opts.steps:
        for g in optim.param_groups:
            g["lr"] = lr_at(step, opts)
        n_tok, loss_sum, batch = 0, 0.0, []
        while n_tok < opts.batch_tokens:
            if not cursor:
                cursor = list(train_idx)
                rng.shuffle(cursor)
            i = cursor.pop()
            batch.append(i)
            n_tok += len(data.tokens[i]) - 1 - data.answer_start[i]
        for i in batch:
            with torch.autocast(model.norm.device.type, dtype=torch.bfloat16, enabled=opts.autocast):
                loss, n, _ = sequence_loss(model, data, i, opts, head_t, local, offset=rng.randrange(opts.block_len))
            (loss / n_tok).backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum / n_tok:.4f}", lr=f"{lr_at(step - 1, opts):.2e}")
        if step % opts.save_every == 0 or step == opts.steps:
            ev = evaluate(model, data, val_idx, opts, head_t, local, val_groups) if val_idx else {}
            history.append({"step": step, "train_loss": loss_sum / n_tok, **ev})
            if ev:
                log(f"step {step}: train loss {loss_sum / n_tok:.4f} val loss {ev['loss']:.4f} "
                    f"agreement {ev['agreement']:.4f} by delay {ev['agreement_by_delay']} "
                    f"by group {ev.get('agreement_by_group', {})}")
            if state_path is not None:
                tmp = Path(state_path).with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step,
                            "history": history, "rng": rng.getstate()}, tmp)
                tmp.replace(state_path)
    bar.close()
    return {"steps": step, "history": history, "train_seconds": round(time.perf_counter() - t0, 1),
            "train_sequences": len(set(train_idx)), "train_rows_per_epoch": len(train_idx),
            "train_positions": sum(len(data.tokens[i]) - 1 - data.answer_start[i] for i in set(train_idx)),
            "val_sequences": len(val_idx)}


def build_model(target, vocab_ids: torch.Tensor, cross_attention: bool = True, **overrides) -> GlideModel:
    """A fresh drafter for ``target`` (initialised from its top layer when shapes allow), in float32 on CPU/GPU."""
    c = GlideConfig.for_target(target.args, target.model_id, cross_attention=cross_attention,
                               vocab_subset=len(vocab_ids), **overrides)
    model = GlideModel(c)
    model.vocab_ids = vocab_ids.clone()
    model.init_from_target(target.model)
    model = model.to(target.device)
    model.attach(target.embed_weight.float(), target.lm_head_weight.float())
    return model


# -- the whole pipeline (``specserve train glide``) ------------------------------------------------------------
def data_sources(items: list[dict]) -> dict[str, int]:
    """Answers per prompt source (`chat`, `humaneval`, `synth`, ...), the target's turns inside synthesized
    conversations counted apart: what a checkpoint's card says it learned from."""
    return dict(sorted(Counter(i.get("source", "") + ("-conversation" if "turn" in i else "") for i in items).items()))


def work_dir(cfg, model_id: str) -> Path:
    from server.model_files import default_cache_dir

    return Path(cfg.model.cache_dir or default_cache_dir()) / "train" / model_id


def ensure_data(cfg, target, data_path: Path | None, max_new_tokens: int, batch_size: int, limit: int | None,
                progress: bool = True, log=print) -> tuple[Path, list[dict]]:
    """The self-distilled answers: a complete file written by ``specserve train data`` is used as it is; otherwise
    the default prompts (project prompts, plus the synthesized ones when ``train prompts`` ran) are answered with the
    batched engine (resumable; training/data.py)."""
    from training.data import AnswerSettings, answer_records, load_responses, prompt_records
    from training.synth import default_out_dir

    path = Path(data_path) if data_path else work_dir(cfg, target.model_id) / "responses.pt"
    data = load_responses(path) if path.exists() else None
    if data is None or not data.get("complete", False):
        records = prompt_records(None, default_out_dir(cfg, target.model_id) / "train.jsonl", log)
        records = records[:limit] if limit else records
        # A file from before the sharded format holds as many items as prompts when it is complete.
        if data is None or "complete" in data or len(data["items"]) < len(records):
            path.parent.mkdir(parents=True, exist_ok=True)
            log(f"generating target answers for {len(records)} prompts into {path}")
            data = answer_records(cfg, target, records, path, AnswerSettings(max_new_tokens=max_new_tokens),
                                  batch=batch_size, progress=progress, log=log)
    if data["model_id"] != target.model_id:
        raise ValueError(f"{path} holds answers of {data['model_id']!r}, not of the target {target.model_id!r}")
    items = data["items"][:limit] if limit else data["items"]
    return path, items


def run_train_glide(cfg, out: Path | None = None, vanilla: bool = False, data_path: Path | None = None,
                    opts: TrainOptions | None = None, vocab_subset: int = 8192, max_new_tokens: int = 256,
                    gen_batch: int = 32, limit: int | None = None, text_tokens: int = 0, progress: bool = True,
                    log=print,
                    **model_overrides) -> Path:
    """Data -> teacher pass -> training -> fp16 checkpoint + card. Returns the checkpoint path."""
    from drafters.glide.model import default_checkpoint
    from training.data import temperature_counts
    from server.engine import load_target
    from server.model_files import load_tokenizer
    from server.tokenization import stop_token_ids

    opts = opts or TrainOptions()
    torch.manual_seed(opts.seed)
    target = load_target(cfg, progress=progress)
    name = "vanilla" if vanilla else "glide"
    out = Path(out) if out else default_checkpoint(target.model_id, name)
    data_file, items = ensure_data(cfg, target, data_path, max_new_tokens, gen_batch, limit, progress, log)
    tokenizer = load_tokenizer(target.hf_dir)
    stops = stop_token_ids(tokenizer, target.args.eos_token_ids)
    vocab_ids = vocab_by_frequency(items, target.args.vocab_size, vocab_subset, stops)
    log(f"{len(items)} sequences, {sum(len(i['response_ids']) for i in items)} answer tokens; kept vocabulary "
        f"{len(vocab_ids)} covers {coverage(items, vocab_ids, target.args.vocab_size):.2%} of answer tokens")
    text_items = []
    if text_tokens:
        from training.text import shipped_text_items
        text_items = shipped_text_items(tokenizer, text_tokens, seed=opts.seed)
        log(f"+ {len(text_items)} sequences ({sum(len(i['response_ids']) + 1 for i in text_items)} tokens) of "
            "shipped text for teacher forcing")
    model = build_model(target, vocab_ids, cross_attention=not vanilla, **model_overrides)
    # The vanilla drafter ignores the K/V, but shares the teacher file (and so the data) with GLIDE.
    read = [model.c.target_layer(m) for m in range(model.c.num_layers)]
    wd = work_dir(cfg, target.model_id)
    wd.mkdir(parents=True, exist_ok=True)
    everything = items + text_items
    layers = f"{opts.max_len}-{'_'.join(map(str, read)) or 'none'}-{str(target.dtype)[6:]}"
    rows = [i for i, it in enumerate(everything) if usable(it, opts.max_len)]
    train_rows, val_rows = split_rows(everything, rows, opts)
    needed = sorted(set(train_rows) | set(val_rows))  # a subset run computes (and holds) only its own sequences
    teacher, _ = cached_teacher(target, [everything[rows[r]] for r in needed], read, opts.max_len,
                                wd / f"teacher-{layers}", progress=progress, log=log)
    at = {r: j for j, r in enumerate(needed)}
    split = ([at[r] for r in train_rows], [at[r] for r in val_rows])
    log(f"training on {len(set(train_rows))} sequences ({len(train_rows)} per epoch with source weights), "
        f"validating on {len(val_rows)}")
    # A resumable run is keyed by its data and recipe: a different run never resumes another's state.
    digest = hashlib.blake2b(json.dumps([teacher_key(everything[rows[r]], opts.max_len) for r in train_rows]
                                        + ["|"] + [teacher_key(everything[rows[r]], opts.max_len) for r in val_rows])
                             .encode(), digest_size=6).hexdigest()
    recipe = f"{layers}-{digest}-{opts.loss}-{opts.steps}-{opts.batch_tokens}-{opts.lr:g}-{opts.seed}-{len(vocab_ids)}"
    state_file = wd / f"{name}-{recipe}-train-state.pt"
    groups: dict[str, list[int]] = {}
    for j, r in zip(split[1], val_rows):  # by prompt source, shipped text as one: a learning curve reads answers'
        groups.setdefault(source_group(everything[rows[r]]), []).append(j)
    summary = train(model, teacher, opts, state_file, progress=progress, log=log, split=split, val_groups=groups)
    card = {
        "target": target.model_id, "drafter": name, "architecture": {
            k: v for k, v in model.c.__dict__.items() if k not in ("extra",)},
        "data": {"file": data_file.name, "sequences": len(items),
                 "answer_tokens": sum(len(i["response_ids"]) for i in items),
                 "prompts": data_sources(items),
                 "answers": "the target's own answers (see the data file's card), at most %d new tokens"
                 % max_new_tokens,
                 "answers_by_temperature": temperature_counts(items),
                 "shipped_text_sequences": len(text_items),
                 "shipped_text_tokens": sum(len(i["response_ids"]) + 1 for i in text_items)},
        "training": {**opts.__dict__, **{k: v for k, v in summary.items() if k != "history"}},
        "validation": summary["history"][-1] if summary["history"] else {},
    }
    model.save(out, card)
    log(f"wrote {out} and {out.with_suffix('.json')}")
    return out


@torch.inference_mode()
def measure_acceptance(cfg, checkpoint: Path, prompts: list[list[int]], gamma: int = 5, temperature: float = 0.0,
                       max_new_tokens: int = 128, cape: bool = False, target=None, stop_ids=()) -> dict:
    """Chain (or CAPE) acceptance of a checkpoint on token-id prompts: acceptance rate and mean accepted length."""
    from core.sampling import SamplingParams
    from drafters.glide.drafter import GlideDrafter
    from server.engine import Engine, load_target

    target = target or load_target(cfg, progress=False)
    drafter = GlideDrafter(target, checkpoint=str(checkpoint), gamma=gamma, cape=cape)
    engine = Engine(cfg, drafter=drafter, target=target)
    draft = acc = steps = emitted = 0
    for i, ids in enumerate(prompts):
        s = SamplingParams(temperature=temperature, seed=i)
        out = engine.generate(ids, s, max_new_tokens, stop_ids)
        draft += out.stats.draft_tokens
        acc += out.stats.accepted_tokens
        steps += out.stats.verify_steps
        emitted += out.stats.step_tokens
    return {"acceptance_rate": round(acc / max(1, draft), 4), "mean_accepted_length": round(emitted / max(1, steps), 4),
            "gamma": gamma, "temperature": temperature, "prompts": len(prompts), "cape": cape}
