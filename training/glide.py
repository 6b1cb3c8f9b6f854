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
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from drafters.glide.model import GlideConfig, GlideModel, block_mask
from training.common import (TrainerOptions, data_sources, held_out, is_shipped_text, lr_at, make_optimizer, resume,
                             save_state, seeded_split, source_group, start_from)
from training.run import prepare_run
from training.teacher import TeacherData, cached_teacher, teacher_key, usable


@dataclass
class TrainOptions(TrainerOptions):
    block_len: int = 5             # the paper's block length for the cross-attention mask
    loss: str = "kl"               # "kl" (to the target's distribution) or "ce" (on the target's tokens)
    train_tokens: int = 0          # > 0: train on a seeded subset of about this many answer tokens (shipped text apart)
    source_weights: tuple[tuple[str, int], ...] = ()  # (source, w): that source's answers come w times per epoch


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


def train(model: GlideModel, data: TeacherData, opts: TrainOptions, state_path: Path | None = None,
          progress: bool = True, log=print, split: tuple[list[int], list[int]] | None = None,
          val_groups: dict[str, list[int]] | None = None) -> dict:
    """Train in place; resumes from ``state_path`` when it exists. Returns a summary for the card. ``split``:
    (train rows, repeats allowed; validation rows), else a seeded ``val_fraction`` of the rows is held out;
    ``val_groups``: validation rows by name, each group's agreement reported apart."""
    rng = random.Random(opts.seed)
    train_idx, val_idx = split if split is not None else seeded_split(len(data), opts.val_fraction, rng)
    head_t, local = loss_tables(model)
    params, optim = make_optimizer(model, opts)
    step, history = resume(state_path, model, optim, rng, log)
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
            save_state(state_path, model, optim, step, history, rng)
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
def run_train_glide(cfg, out: Path | None = None, vanilla: bool = False, data_path: Path | None = None,
                    opts: TrainOptions | None = None, vocab_subset: int = 8192, max_new_tokens: int = 256,
                    gen_batch: int = 32, limit: int | None = None, text_tokens: int = 0, init: Path | None = None,
                    progress: bool = True, log=print, **model_overrides) -> Path:
    """Data -> teacher pass -> training -> fp16 checkpoint + card. Returns the checkpoint path.

    ``init``: start from that checkpoint (its shape and kept vocabulary; ``model_overrides`` and ``vanilla`` must not
    be given) with a fresh optimizer; its agreement on this run's validation split is the step-0 entry."""
    from drafters.glide.model import GlideModel, check_fits, default_checkpoint
    from training.data_card import temperature_counts

    if init and (model_overrides or vanilla):  # before any data or model is loaded: an argument error
        raise ValueError("--init takes the checkpoint's shape: no shape options or --vanilla with it")
    opts = opts or TrainOptions()
    run = prepare_run(cfg, opts.seed, data_path, max_new_tokens, gen_batch, limit, vocab_subset, text_tokens,
                      progress, log)
    target, items, text_items, vocab_ids, wd = run.target, run.items, run.text_items, run.vocab_ids, run.work
    name = "vanilla" if vanilla else "glide"
    out = Path(out) if out else default_checkpoint(target.model_id, name)
    started = None
    if init:
        model, started = start_from(GlideModel.load, check_fits, init, target, log)
        vocab_ids = model.vocab_ids.clone()
    else:
        model = build_model(target, vocab_ids, cross_attention=not vanilla, **model_overrides)
    # The vanilla drafter ignores the K/V, but shares the teacher file (and so the data) with GLIDE.
    read = [model.c.target_layer(m) for m in range(model.c.num_layers)]
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
    recipe = (f"{layers}-{digest}-{opts.loss}-{opts.steps}-{opts.batch_tokens}-{opts.lr:g}-{opts.seed}-{len(vocab_ids)}"
              + (f"-init{started['digest'][:12]}" if started else ""))
    state_file = wd / f"{name}-{recipe}-train-state.pt"
    groups: dict[str, list[int]] = {}
    for j, r in zip(split[1], val_rows):  # by prompt source, shipped text as one: a learning curve reads answers'
        groups.setdefault(source_group(everything[rows[r]]), []).append(j)
    summary = train(model, teacher, opts, state_file, progress=progress, log=log, split=split, val_groups=groups)
    card = {
        "target": target.model_id, "drafter": name, "architecture": {
            k: v for k, v in model.c.__dict__.items() if k not in ("extra",)},
        "data": {"file": run.data_file.name, "sequences": len(items),
                 "answer_tokens": sum(len(i["response_ids"]) for i in items),
                 "prompts": data_sources(items),
                 "answers": "the target's own answers (see the data file's card), at most %d new tokens"
                 % max_new_tokens,
                 "answers_by_temperature": temperature_counts(items),
                 "shipped_text_sequences": len(text_items),
                 "shipped_text_tokens": sum(len(i["response_ids"]) + 1 for i in text_items)},
        "training": {**opts.__dict__, **{k: v for k, v in summary.items() if k != "history"},
                     "init": started},
        "validation": summary["history"][-1] if summary["history"] else {},
        "history": summary["history"],
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
