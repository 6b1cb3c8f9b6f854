"""Train the Falcon drafting head for a target: ``specserve train falcon``.

Pipeline (cached under ``<cache>/train/<target id>/`` like GLIDE's, so a rerun resumes):
  1. data     the target's own answers to the training prompts (``train data``; shared with GLIDE);
  2. teacher  one target forward per sequence stores its post-norm features f_0 .. f_{T-1} (bfloat16);
  3. train    Coupled Sequential Glancing Distillation (training/falcon_loss.py), AdamW with warmup and cosine
              decay, resumable;
  4. export   fp16 safetensors + a JSON card under drafters/checkpoints/<target>/falcon.safetensors.

This module runs the pipeline and the training loop: whole sequences until a step has ``batch_tokens`` loss rows, run
in packs (``pack_rows``), held-out agreement every ``save_every`` steps, and with ``seconds`` as many steps as fit in
that wall time. The teacher features are training/falcon_features.py's; the rows, the two streams of CSGD, glancing,
the training-time test and the loss are training/falcon_loss.py's.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from drafters.falcon.model import FalconConfig, FalconModel
from training.common import (cap_sources, data_sources, held_out, lr_at, make_optimizer, resume, save_state,
                             seeded_split, source_group, start_from)
from training.falcon_features import FeatureData, cached_features, features_tag
from training.falcon_loss import FalconTrainOptions, loss_tables, pack_loss, row_counts, sequence_loss
from training.run import prepare_run


@torch.no_grad()
def evaluate(model: FalconModel, data: FeatureData, idx: list[int], opts: FalconTrainOptions, tables: dict,
             groups: dict[str, list[int]] | None = None) -> dict:
    """Held-out agreement with the target's top-1: per position of the first drafted block (teacher-forced inputs)
    and for the second block (inputs the drafter guessed, no glancing; also over the blocks whose guessed tokens were
    all right); the first block's also by ``groups`` (name -> sequences of ``idx``, e.g. by prompt source)."""
    model.eval()
    k = model.c.k
    tot = n = 0.0
    hit_t, cnt_t, hit_p, cnt_p, hit_r, cnt_r = [0] * k, [0] * k, 0, 0, 0, 0
    per_seq = {}
    for i in idx:
        r = sequence_loss(model, data, i, opts, tables, train=False)
        if r is None:
            continue
        loss, rows, st = r
        tot += float(loss)
        n += rows
        for j, (h, c) in enumerate(st["agree_true"]):
            hit_t[j] += h
            cnt_t[j] += c
        hit_p += st["agree_pred"][0]
        cnt_p += st["agree_pred"][1]
        h, c = st.get("agree_pred_right", (0, 0))
        hit_r += h
        cnt_r += c
        per_seq[i] = (sum(h for h, _ in st["agree_true"]), sum(c for _, c in st["agree_true"]))
    model.train()
    by_pos = [round(h / max(1, c), 4) for h, c in zip(hit_t, cnt_t)]
    out = {"loss": tot / max(1, n), "agreement": round(sum(hit_t) / max(1, sum(cnt_t)), 4),
           "agreement_by_position": by_pos, "agreement_second_block": round(hit_p / max(1, cnt_p), 4),
           "agreement_second_block_first_right": round(hit_r / max(1, cnt_r), 4)}
    if groups:
        out["agreement_by_group"] = {
            name: round(sum(per_seq[i][0] for i in rows if i in per_seq)
                        / max(1, sum(per_seq[i][1] for i in rows if i in per_seq)), 4)
            for name, rows in groups.items() if rows}
    return out


def packs(seqs: list[tuple[int, int, int]], pack_rows: int) -> list[list[tuple[int, int, int]]]:
    """(sequence, offset, rows its forward runs) in order -> consecutive packs of at most ``pack_rows`` rows (a
    longer sequence alone; 0: one sequence per pack)."""
    out: list[list[tuple[int, int, int]]] = []
    size = 0
    for q in seqs:
        if not out or size + q[2] > pack_rows:
            out.append([])
            size = 0
        out[-1].append(q)
        size += q[2]
    return out


PROBE_STEPS = (5, 25)  # with ``seconds``: the pace is timed between these steps (warm-up excluded)


def steps_for_seconds(seconds: float, elapsed: float, done: int, per_step: float, eval_seconds: float,
                      save_every: int) -> int:
    """The total steps that fit in ``seconds`` of training when ``done`` steps took ``elapsed`` and each further
    step costs ``per_step``, plus an evaluation of ``eval_seconds`` every ``save_every`` steps (never fewer than
    ``done``)."""
    per = per_step + eval_seconds / max(1, save_every)
    return done + max(0, int((seconds - elapsed) / per)) if per > 0 else done


def train(model: FalconModel, data: FeatureData, opts: FalconTrainOptions, state_path: Path | None = None,
          progress: bool = True, log=print, split: tuple[list[int], list[int]] | None = None,
          val_groups: dict[str, list[int]] | None = None) -> dict:
    """Train in place; resumes from ``state_path`` when it exists. Returns a summary for the card. ``split``:
    (train, validation) sequences, else a seeded ``val_fraction`` of them is held out; ``val_groups``: validation
    sequences by name, each group's agreement reported apart."""
    rng = random.Random(opts.seed)
    train_idx, val_idx = split if split is not None else seeded_split(len(data), opts.val_fraction, rng)
    tables = loss_tables(model)
    pack_rows = opts.pack_rows if opts.pack_rows is not None else 16384 if model.fuse.device.type == "cuda" else 0
    params, optim = make_optimizer(model, opts)
    step, history = resume(state_path, model, optim, rng, log)
    model.train()
    t_start, eval_seconds = time.perf_counter(), 0.0
    if val_idx and step == 0:
        first = evaluate(model, data, val_idx, opts, tables, val_groups)
        eval_seconds = time.perf_counter() - t_start
        log(f"step 0: val {first}")
        history.append({"step": 0, **first})
    budget = opts.seconds is not None and step <= PROBE_STEPS[0]
    if budget:  # the pace is unknown yet: run the probe as a whole, then set the steps
        opts.steps = max(opts.steps, PROBE_STEPS[1])
    cursor: list[int] = []
    bar = tqdm(total=opts.steps, initial=step, desc="train falcon", unit="step", disable=not progress)
    t0 = time.perf_counter()
    while step < opts.steps:
        for g in optim.param_groups:
            g["lr"] = lr_at(step, opts)
        lam = opts.glance * (opts.steps - step) / opts.steps
        step_seqs, n_rows, loss_sum, ham = [], 0, 0.0, 0
        while n_rows < opts.batch_tokens:  # whole sequences until the step has batch_tokens loss rows
            if not cursor:
                cursor = list(train_idx)
                rng.shuffle(cursor)
            i = cursor.pop()
            offset = rng.randrange(model.c.k)
            rows, run = row_counts(len(data.tokens[i]), data.answer_start[i], model.c.k, opts.csgd)
            if rows:
                step_seqs.append((i, offset, run))
                n_rows += rows
        for pack in packs(step_seqs, pack_rows):
            with torch.autocast(model.fuse.device.type, dtype=torch.bfloat16, enabled=opts.autocast):
                loss, _, st = pack_loss(model, data, [i for i, _, _ in pack], opts, tables,
                                        [o for _, o, _ in pack], lam=lam, rng=rng)
            (loss / opts.batch_tokens).backward()
            loss_sum += float(loss.detach())
            ham += st.get("hamming", 0)
        torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum / n_rows:.4f}", lam=f"{lam:.2f}", ham=ham)
        if budget and step in PROBE_STEPS:  # time steps 5 to 25, then set the steps that fit
            if model.fuse.device.type == "cuda":
                torch.cuda.synchronize()
            if step == PROBE_STEPS[0]:
                t_probe = time.perf_counter()
            else:
                per_step = (time.perf_counter() - t_probe) / (PROBE_STEPS[1] - PROBE_STEPS[0])
                opts.steps = steps_for_seconds(opts.seconds, time.perf_counter() - t_start, step, per_step,
                                               eval_seconds, opts.save_every)
                bar.total = opts.steps
                log(f"{per_step:.4f} s per step, {eval_seconds:.1f} s per evaluation: {opts.steps} steps fit in "
                    f"{opts.seconds:g} s")
        if step % opts.save_every == 0 or step == opts.steps:
            ev = evaluate(model, data, val_idx, opts, tables, val_groups) if val_idx else {}
            history.append({"step": step, "train_loss": loss_sum / n_rows, **ev})
            if ev:
                log(f"step {step}: train loss {loss_sum / n_rows:.4f} val {ev}")
            save_state(state_path, model, optim, step, history, rng)
    bar.close()
    return {"steps": step, "history": history, "train_seconds": round(time.perf_counter() - t0, 1),
            "train_sequences": len(train_idx), "val_sequences": len(val_idx)}


def hash_split(data: FeatureData, items: list[dict], opts: FalconTrainOptions):
    """((train, validation) sequences, validation sequences by prompt source): held out by a hash of the prompt, the
    same prompts GLIDE's training holds out (``training.common.held_out``), so the two read alike."""
    train_idx, val_idx, groups = [], [], {}
    for i, n in enumerate(data.index):
        it = items[n]
        if held_out(it["prompt_ids"], opts.seed, opts.val_fraction):
            val_idx.append(i)
            groups.setdefault(source_group(it), []).append(i)
        else:
            train_idx.append(i)
    return (train_idx, val_idx), groups


def build_model(target, vocab_ids: torch.Tensor, k: int = 2, taps: list[int] | None = None) -> FalconModel:
    """A fresh head for ``target`` (random matrices, norms from the target's), float32."""
    model = FalconModel(FalconConfig.for_target(target.args, target.model_id, k=k, vocab_subset=len(vocab_ids),
                                                taps=list(taps or [])))
    model.vocab_ids = vocab_ids.clone()
    model.init_from_target(target.model)
    model = model.to(target.device)
    return model.attach(target.embed_weight.float(), target.lm_head_weight.float())


def with_taps(model: FalconModel, taps: list[int], target) -> FalconModel:
    """``model`` reading the lower target layers ``taps`` instead of its own: the shared weights copied, the tap
    weights of layers it already read kept, new ones zero (so the head starts computing what it computed)."""
    c = FalconConfig(**{**model.c.__dict__, "taps": list(taps)})
    out = FalconModel(c).to(model.fuse.device)
    out.vocab_ids = model.vocab_ids.clone()
    state = {name: p for name, p in model.state_dict().items() if not name.startswith("tap_")}
    out.load_state_dict(state, strict=False)
    W = c.hidden_size
    with torch.no_grad():
        for j, n in enumerate(taps):
            if n in model.c.taps:
                i = model.c.taps.index(n)
                out.tap_norm[j * W:(j + 1) * W] = model.tap_norm[i * W:(i + 1) * W]
                out.tap_fuse[:, j * W:(j + 1) * W] = model.tap_fuse[:, i * W:(i + 1) * W]
    return out.attach(target.embed_weight.float(), target.lm_head_weight.float())


def run_train_falcon(cfg, out: Path | None = None, data_path: Path | None = None,
                     opts: FalconTrainOptions | None = None, k: int = 2, vocab_subset: int = 8192,
                     max_new_tokens: int = 256, gen_batch: int = 64, limit: int | None = None, text_tokens: int = 0,
                     init: Path | None = None, taps: list[int] | None = None, progress: bool = True,
                     log=print) -> Path:
    """Data -> teacher features -> CSGD training -> fp16 checkpoint + card. Returns the checkpoint path.

    ``init``: start from that checkpoint (its shape, block size k and kept vocabulary) instead of a fresh head, with a
    fresh optimizer (warm-up, then the schedule); its agreement on this run's validation split is the step-0 entry.
    ``taps``: the lower target layers the head reads (``FalconConfig.taps``); None keeps the checkpoint's (none for a
    new head); a checkpoint without taps gains them with ``with_taps``."""
    from drafters.falcon.model import check_fits, default_checkpoint

    opts = opts or FalconTrainOptions()
    run = prepare_run(cfg, opts.seed, data_path, max_new_tokens, gen_batch, limit, vocab_subset, text_tokens,
                      progress, log)
    target, items, text_items, vocab_ids, wd = run.target, run.items, run.text_items, run.vocab_ids, run.work
    if opts.source_tokens:
        items = cap_sources(items, dict(opts.source_tokens), opts.seed)
        log(f"{len(items)} sequences after --source-tokens, {sum(len(i['response_ids']) for i in items)} answer "
            f"tokens: {data_sources(items)}")
    out = Path(out) if out else default_checkpoint(target.model_id)
    started = None
    if init:
        model, started = start_from(FalconModel.load, check_fits, init, target, log)
        vocab_ids, k = model.vocab_ids.clone(), model.c.k
        if taps is not None and list(taps) != list(model.c.taps):
            model = with_taps(model, taps, target)
    else:
        model = build_model(target, vocab_ids, k, taps or [])
    taps = list(model.c.taps)
    seqs = items + text_items
    tag = features_tag(seqs, len(text_items), opts.max_len, target.dtype)
    data = cached_features(target, seqs, opts.max_len, wd / f"features-{tag}.pt", taps, progress, log)
    if not taps:
        data.taps = []  # a file with lower layers serves a head without them (or with fewer)
    objective = "tf" if not opts.csgd else "ttt" if opts.ttt else "csgd"
    recipe = (f"{tag}-k{k}-{objective}-{opts.steps}-{opts.batch_tokens}-{opts.lr:g}-{opts.seed}-"
              f"{len(vocab_ids)}-w{opts.w_dist:g}" + (f"-r{opts.w_reg:g}" if opts.w_reg != 1 else "") + "-h"
              + (f"-init{started['digest'][:12]}" if started else "")
              + (f"-taps{'.'.join(map(str, taps))}" if taps else ""))
    split, groups = hash_split(data, items + text_items, opts)
    log(f"training on {len(split[0])} sequences, validating on {len(split[1])} (held out by prompt hash, as GLIDE's)")
    # a run on a time budget starts afresh (its steps depend on the machine's pace); one of N steps resumes
    state = None if opts.seconds is not None else wd / f"falcon-{recipe}-train-state.pt"
    summary = train(model, data, opts, state, progress=progress, log=log, split=split, val_groups=groups)
    card = {
        "target": target.model_id, "drafter": "falcon",
        "architecture": {key: v for key, v in model.c.__dict__.items() if key != "extra"},
        "data": {"file": run.data_file.name, "sequences": len(items),
                 "answer_tokens": sum(len(i["response_ids"]) for i in items), "prompts": data_sources(items),
                 "shipped_text_sequences": len(text_items)},
        "training": {**opts.__dict__, **{key: v for key, v in summary.items() if key != "history"},
                     "init": started},
        "validation": summary["history"][-1] if summary["history"] else {},
        "history": summary["history"],
    }
    model.save(out, card)
    log(f"wrote {out} and {out.with_suffix('.json')}")
    return out
