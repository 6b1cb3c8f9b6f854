"""Train the Falcon drafting head for a target: ``specserve train falcon``.

Pipeline (cached under ``<cache>/train/<target id>/`` like GLIDE's, so a rerun resumes):
  1. data     the target's own answers to the training prompts (``train data``; shared with GLIDE);
  2. teacher  one target forward per sequence stores its post-norm features f_0 .. f_{T-1} (bfloat16);
  3. train    Coupled Sequential Glancing Distillation (below), AdamW with warmup and cosine decay, resumable;
  4. export   fp16 safetensors + a JSON card under drafters/checkpoints/<target>/falcon.safetensors.

**Rows.** Position p >= 1 of a sequence is one row with input (t_p, f_{p-1}); blocks of k positions (boundaries shifted
by a random offset per sequence); the row at position j of its block predicts f_{j+k-1} and t_{j+k}
(``drafters/falcon/model.py``). Only rows whose label t_{j+k} is an answer token are in the loss.

**CSGD** (paper section 3.2), two passes per sequence:
  1. Without gradient, the *true stream*: every row gets its true input (features noised with U(-0.1, 0.1)). The
     outputs of block B are the drafter's guesses at the inputs of block B + 1: the *predicted input* of position
     p is (t_hat_p, f_hat_{p-1}) from row p - k. This is what the drafter reads at inference for every block after
     the first.
  2. Glancing: the Hamming distance d between the predicted tokens t_hat_p and the target's tokens t_p, over the
     loss rows, sets N = round(lambda * d), lambda = glance * (steps - step) / steps (0.4 in the paper). N predicted
     inputs are replaced by the true ones, as runs from the start of randomly chosen blocks (a block's inputs, from
     its first, are what its predictions build on).
  3. With gradient, one forward over both streams: the true stream (rows see true rows of their own and earlier
     blocks: the first drafted block at inference) and the *predicted stream* (a row of block B sees the true rows of
     blocks before B and the predicted/glanced rows of block B: the second drafted block at inference, whose context
     is verified text and whose own inputs are the drafter's guesses). Loss on both streams' loss rows:
        L = w_reg * SmoothL1(f_hat, f) + w_dist * (0.9 * KL(p || p_draft) + 0.1 * CE(t, p_draft))
     over the kept vocabulary, p = the target's next-token distribution softmax(LM(f)); the paper's w_dist is 0.1,
     ours 1.0; w_reg = 0 drops the regression, as EAGLE-3 does (the head's output feature is then free: only the
     tokens it yields are trained).
No row sees its label: a block's labels are the next block's tokens, which neither stream shows it; so glanced rows
stay in the loss (their inputs are true inputs, not their labels). ``csgd=False`` is plain teacher forcing (the
true stream alone), the paper's ablation.

**Training-time test** (``ttt=True``, after EAGLE-3): the predicted stream reads the *true* tokens with the head's own
predicted features (no target layers behind them) and nothing is glanced. A second drafted block is only worth
anything when the first was accepted, and then its input tokens are the target's: guessed tokens that are wrong train
rows that inference throws away. Evaluation reads guessed tokens either way and also reports the second block's
agreement over the blocks whose guessed inputs were all right (what the served second block meets).

**Packing** (``pack_rows``): a step's sequences run in forwards of up to that many rows, each sequence's rows seeing
only their own (``pack_loss``), which gives the losses and gradients of one forward per sequence. On CUDA (default
16,384 rows) it turns a launch-bound step into one forward and backward; on a CPU a pack costs more than its sequences
apart, so the default there is one sequence per forward.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from drafters.falcon.model import FalconConfig, FalconModel, block_ids, relaxed_mask
from training.common import (TrainerOptions, answers_digest, cap_sources, data_sources, held_out, lr_at,
                             make_optimizer, resume, save_state, seeded_split, source_group, start_from)
from training.run import prepare_run
from training.teacher import padded_pass, teacher_pass


@dataclass
class FalconTrainOptions(TrainerOptions):
    csgd: bool = True              # False: plain teacher forcing (the ablation)
    glance: float = 0.4            # lambda at step 0, decaying linearly to 0
    noise: float = 0.1             # U(-noise, noise) on input features
    w_dist: float = 1.0            # L = w_reg * SmoothL1 + w_dist * (alpha * KL + (1 - alpha) * CE); paper: 0.1
    w_reg: float = 1.0             # 0 drops the feature regression (EAGLE-3's choice): tokens alone train the head
    alpha: float = 0.9
    ttt: bool = False              # training-time test: the predicted stream reads true tokens, predicted features
    pack_rows: int | None = None   # rows per training forward, sequences packed (None: 16384 on CUDA, else 0 = one)
    seconds: float | None = None   # train for this wall time: ``steps`` is set from the first steps' pace
    source_tokens: tuple[tuple[str, int], ...] = ()  # (source, n): that source's answers cut to about n tokens


@dataclass
class FeatureData:
    tokens: list[torch.Tensor]   # per sequence [T] long
    answer_start: list[int]      # prompt_len - 1: the first position whose next token is an answer token
    feats: list[torch.Tensor]    # per sequence [T, hidden] post-norm target features (bfloat16)
    index: list[int] = field(default_factory=list)  # per sequence: its position in the items the pass read
    taps: list[torch.Tensor] = field(default_factory=list)  # per sequence [T, n_taps, hidden] lower layers (bfloat16)
    tap_layers: list[int] = field(default_factory=list)     # the layer counts ``taps`` holds

    def __len__(self) -> int:
        return len(self.tokens)

    def tap_rows(self, i: int, layers: list[int]) -> torch.Tensor:
        """Sequence i's lower-layer rows [T, len(layers), hidden] for ``layers``, in that order (any the file holds)."""
        return self.taps[i][:, [self.tap_layers.index(n) for n in layers]]


def features_tag(seqs: list[dict], n_text: int, max_len: int, dtype: torch.dtype) -> str:
    """The name of a teacher pass over ``seqs`` (the last ``n_text`` of them shipped text), keyed by content: another
    data set of the same size is not it. ``train falcon`` and ``train accept-head --drafter falcon`` share the file."""
    return f"{len(seqs) - n_text}+{n_text}-{max_len}-{str(dtype)[6:]}-{answers_digest(seqs)}"


def cached_features(target, items: list[dict], max_len: int, path: Path, taps: list[int], progress: bool = True,
                    log=print) -> FeatureData:
    """``teacher_features`` kept in ``path`` (the caller names it by content): read when it is there, keeps every
    sequence's item index and holds the lower layers ``taps``, else computed and written."""
    data = FeatureData(**torch.load(path, weights_only=True)) if path.exists() else None
    # none yet, written before sequences kept their item index, or without the lower layers the head reads
    if data is None or len(data.index) != len(data) or not set(taps) <= set(data.tap_layers):
        t0 = time.perf_counter()
        data = teacher_features(target, items, max_len, progress=progress, taps=tuple(taps))
        if target.device.type != "cuda":  # a GPU computes the pass faster than it would read the file back
            torch.save(data.__dict__, path)
        log(f"teacher pass: {len(data)} sequences in {time.perf_counter() - t0:.0f} s")
    return data


def teacher_features(target, items: list[dict], max_len: int, progress: bool = True,
                     taps: tuple[int, ...] = ()) -> FeatureData:
    """The teacher pass (``training.teacher``) for Falcon: every position's final-normed target features (and the
    residual stream after each layer count in ``taps``), for the sequences with at least 3 answer positions. An
    unquantized target on a GPU runs it as padded batches (``padded_pass``, its features left on the GPU)."""
    if target.device.type == "cuda" and target.quantization == "none":
        t = padded_pass(target, items, max_len, min_answer=3, taps=tuple(taps))
    else:
        t = teacher_pass(target, items, [], max_len, progress=progress, all_positions=True, min_answer=3,
                         taps=tuple(taps))
    return FeatureData(t.tokens, t.answer_start, t.hidden, t.index, t.taps, list(taps))


def two_stream_mask(true_blocks: torch.Tensor, pred_blocks: torch.Tensor) -> torch.Tensor:
    """[n + m, n + m] bool for the true stream's n rows then the predicted stream's m rows (each in position order):
    a true row sees true rows of its own and earlier blocks; a predicted row of block B sees true rows of blocks
    before B and the predicted rows of block B."""
    n, m = len(true_blocks), len(pred_blocks)
    mask = torch.zeros(n + m, n + m, dtype=torch.bool, device=true_blocks.device)
    mask[:n, :n] = true_blocks[None, :] <= true_blocks[:, None]
    mask[n:, :n] = true_blocks[None, :] < pred_blocks[:, None]
    mask[n:, n:] = pred_blocks[None, :] == pred_blocks[:, None]
    return mask


def glance_rows(blocks: torch.Tensor, n_glance: int, rng: random.Random) -> torch.Tensor:
    """Which predicted-stream rows (blocks: their block ids, in position order) get their true input back: runs from
    the start of randomly chosen blocks, ``n_glance`` rows in all -> [m] bool."""
    out = torch.zeros(len(blocks), dtype=torch.bool)
    if n_glance <= 0 or not len(blocks):
        return out
    ids = blocks.tolist()
    starts: dict[int, list[int]] = {}
    for r, b in enumerate(ids):
        starts.setdefault(b, []).append(r)
    order = list(starts)
    rng.shuffle(order)
    left = n_glance
    for b in order:
        rows = starts[b][:left]
        out[rows] = True
        left -= len(rows)
        if left <= 0:
            break
    return out


def all_right_in_block(blocks: torch.Tensor, wrong: torch.Tensor) -> torch.Tensor:
    """[m] bool: the rows (``blocks``: their block ids) of blocks none of whose rows has ``wrong`` set, i.e. the
    predicted-stream rows whose block of guessed inputs the chain would have accepted whole."""
    bad = torch.zeros(int(blocks.max()) + 1 if len(blocks) else 0, dtype=torch.long, device=blocks.device)
    bad.index_add_(0, blocks, wrong.long())
    return bad[blocks] == 0


def row_counts(T: int, start: int, k: int, two_streams: bool) -> tuple[int, int]:
    """A sequence of T tokens whose answer starts after position ``start``: (its loss rows, the rows its forward runs),
    both streams' with ``two_streams``; what ``pack_loss`` reports, known before it runs (steps and packs are cut by
    it)."""
    hi, lo = T - 1 - k, max(1, start + 1 - k)      # positions j whose label t_{j+k} is an answer token
    n = max(0, hi - lo + 1)
    m = max(0, hi - max(lo, k + 1) + 1) if two_streams else 0  # the second stream's: j >= k + 1
    return n + m, max(0, T - 1) + m


def sequence_loss(model: FalconModel, data: FeatureData, i: int, opts: FalconTrainOptions, tables: dict,
                  offset: int = 0, lam: float = 0.0, rng: random.Random | None = None, train: bool = True):
    """``pack_loss`` of sequence i alone."""
    return pack_loss(model, data, [i], opts, tables, [offset], lam, rng, train)


def pack_loss(model: FalconModel, data: FeatureData, seqs: list[int], opts: FalconTrainOptions, tables: dict,
              offsets: list[int] | None = None, lam: float = 0.0, rng: random.Random | None = None,
              train: bool = True):
    """Loss summed over the loss rows of sequences ``seqs`` (block boundaries shifted by ``offsets``), run as one
    forward in which each sequence's rows see their own alone (both streams with CSGD) -> (loss, rows, stats), or None
    when none has a loss row. One sequence per forward leaves a small head's GPU idle between kernel launches; a pack
    of them fills it (glancing then draws its N = round(lambda * d) over the pack)."""
    c, dev = model.c, model.fuse.device
    k = c.k
    offsets = offsets or [0] * len(seqs)
    parts = {n: [] for n in ("ids", "fin", "pos", "seg", "blocks", "off", "taps", "rows", "lab_tok", "lab_feat")}
    n_rows = base = 0
    for s, (i, off) in enumerate(zip(seqs, offsets)):
        tok = data.tokens[i].to(dev)
        feats = data.feats[i].to(dev, torch.float32)
        T, start = len(tok), data.answer_start[i]
        pos = torch.arange(1, T, device=dev)             # rows: positions 1 .. T-1 (row index = position - 1)
        blocks = block_ids(pos, k, off)
        # loss rows: position j with label t_{j+k} inside the sequence and in the answer
        lab_pos = pos + k
        rows = ((lab_pos <= T - 1) & (lab_pos >= start + 1)).nonzero().squeeze(1)
        for name, v in (("ids", tok[1:]), ("fin", feats[:-1]), ("pos", pos), ("seg", torch.full_like(pos, s)),
                        ("blocks", blocks + base), ("off", torch.full_like(pos, off)), ("rows", rows + n_rows),
                        ("lab_tok", tok[lab_pos[rows]]), ("lab_feat", feats[lab_pos[rows] - 1])):  # t_{j+k}, f_{j+k-1}
            parts[name].append(v)
        if c.taps:  # the lower layers at p - 1, in the head's order
            parts["taps"].append(data.tap_rows(i, c.taps)[:-1].to(dev, torch.float32))
        n_rows += T - 1
        base += int(blocks[-1]) + 1 if T > 1 else 0    # block ids stay distinct across the pack
    ids, fin, pos, seg, blocks, off, rows, label_tok, label_feat = (
        torch.cat(parts[n]) for n in ("ids", "fin", "pos", "seg", "blocks", "off", "rows", "lab_tok", "lab_feat"))
    if not len(rows):
        return None
    taps = torch.cat(parts["taps"]) if c.taps else None
    if train and opts.noise:
        fin = fin + (torch.rand_like(fin) * 2 - 1) * opts.noise
    true_mask = (seg[None, :] == seg[:, None]) & relaxed_mask(blocks)  # each sequence's own rows alone
    # predicted inputs exist from position k + 1 on; evaluation measures the second block with or without CSGD
    pred_at = pos[rows] >= k + 1 if opts.csgd or not train else torch.zeros_like(rows, dtype=torch.bool)
    pred_rows = rows[pred_at]
    stats = {}
    if len(pred_rows):
        with torch.no_grad():  # pass 1: the true stream
            f1 = model(ids, fin, pos, true_mask, taps=taps)
            src = pred_rows - k                               # the rows that guessed these rows' inputs
            guess = tables["vocab_ids"][model.logits(f1[src]).argmax(-1)]
        true_in = ids[pred_rows]
        wrong = guess != true_in
        stats["hamming"] = int(wrong.sum())
        ttt = opts.ttt and train
        n_glance = 0 if ttt else round(lam * stats["hamming"])
        glanced = glance_rows(blocks[pred_rows].cpu(), n_glance, rng or random.Random(0)).to(dev)
        stats["glanced"] = int(glanced.sum())
        p_ids = true_in if ttt else torch.where(glanced, true_in, guess)
        p_feats = torch.where(glanced[:, None], fin[pred_rows], f1[src].float())
        all_ids = torch.cat([ids, p_ids])
        all_feats = torch.cat([fin, p_feats])
        all_pos = torch.cat([pos, pos[pred_rows]])
        all_seg = torch.cat([seg, seg[pred_rows]])
        all_taps = None
        if taps is not None:  # a predicted input has no target layers behind it: zeros, as at inference
            all_taps = torch.cat([taps, torch.where(glanced[:, None, None], taps[pred_rows], 0.0)])
        mask = two_stream_mask(blocks, blocks[pred_rows]) & (all_seg[None, :] == all_seg[:, None])
        out = model(all_ids, all_feats, all_pos, mask, taps=all_taps)
        sel = torch.cat([rows, len(pos) + torch.arange(len(pred_rows), device=dev)])
        label_tok = torch.cat([label_tok, label_tok[pred_at]])
        label_feat = torch.cat([label_feat, label_feat[pred_at]])
    else:
        out = model(ids, fin, pos, true_mask, taps=taps)
        sel = rows
    f_hat = out[sel].float()
    logits = model.logits(f_hat).float()
    with torch.no_grad():
        t_logp = F.log_softmax(label_feat @ tables["head_t"], dim=-1)
    logp = F.log_softmax(logits, dim=-1)
    reg = F.smooth_l1_loss(f_hat, label_feat, reduction="none").mean(-1).sum()
    kl = (t_logp.exp() * (t_logp - logp)).sum()
    local = tables["local"][label_tok]
    ce = F.nll_loss(logp, local.clamp(min=0), reduction="none")[local >= 0].sum()
    loss = opts.w_reg * reg + opts.w_dist * (opts.alpha * kl + (1 - opts.alpha) * ce)
    with torch.no_grad():
        agree = logits.argmax(-1) == t_logp.argmax(-1)
        n_true = len(rows)
        in_block = (pos[rows] + off[rows]) % k
        stats["agree_true"] = [(int(agree[:n_true][in_block == j].sum()), int((in_block == j).sum()))
                               for j in range(k)]
        stats["agree_pred"] = (int(agree[n_true:].sum()), int(len(agree) - n_true))
        if len(pred_rows) and not train:  # evaluation alone reads it
            right = all_right_in_block(blocks[pred_rows], wrong)
            stats["agree_pred_right"] = (int(agree[n_true:][right].sum()), int(right.sum()))
    return loss, len(sel), stats


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


def loss_tables(model: FalconModel) -> dict:
    dev = model.vocab_ids.device
    local = torch.full((model.c.vocab_size,), -1, dtype=torch.long, device=dev)
    local[model.vocab_ids] = torch.arange(len(model.vocab_ids), device=dev)
    return {"head_t": model.head_weight.float().t().contiguous(), "local": local, "vocab_ids": model.vocab_ids}


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
