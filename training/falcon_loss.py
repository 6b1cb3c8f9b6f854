"""The loss of Falcon's training: its rows, Coupled Sequential Glancing Distillation and the training-time test.

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafters.falcon.model import FalconModel, block_ids, relaxed_mask
from training.common import TrainerOptions
from training.falcon_features import FeatureData


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


def loss_tables(model: FalconModel) -> dict:
    dev = model.vocab_ids.device
    local = torch.full((model.c.vocab_size,), -1, dtype=torch.long, device=dev)
    local[model.vocab_ids] = torch.arange(len(model.vocab_ids), device=dev)
    return {"head_t": model.head_weight.float().t().contiguous(), "local": local, "vocab_ids": model.vocab_ids}
