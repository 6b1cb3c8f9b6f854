"""Train an acceptance head (drafters/adaptive.py) for a chain drafter: ``specserve train accept-head``.

Pipeline (cached under ``<cache>/train/<target id>/`` like the drafters' own training):
  1. data     the target's own answers (``train data``), and GLIDE's teacher pass (the target's K/V of the layers the
              drafter reads, its final-normed states at the answer positions);
  2. examples the drafter drafts at every answer position and depth, as it would at inference (below), and each drafted
              token gets its label: 1[Y = argmax p] for greedy requests, min(1, p(Y) / q(Y)) (the chance our acceptance
              rule keeps it) for sampled ones, p and q under the request's temperature;
  3. train    weighted BCE, the rejections weighted ``reject_weight`` (the paper's w), AdamW;
  4. export   safetensors + a JSON card (data, recipe, held-out AUC and calibration).

**Drafting as at inference, conditioned on acceptance.** The head predicts P(Y_d accepted | Y_1..Y_{d-1} accepted)
from the drafter's hidden state that Y_d was drafted from. Given acceptance, the tokens before Y_d are the verified
text itself, so for depth d, root s and Y_d at position p = s + d, that state is the drafter's row at p - 1 over the
true text, seeing the target's K/V before s only (what verification had cached when the round began). One forward per
depth (``delayed_rows``: every row r sees the target keys before r - (d - 1)) does every position at once, exactly:
no token mixing is needed (the paper mixes drafted tokens into the inputs to approximate this condition).
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from core.sampling import SamplingParams, target_probs
from drafters.adaptive import AcceptHead, AcceptHeadConfig, checkpoint_digest, default_checkpoint
from drafters.checkpoint import CHECKPOINT_DIR
from training.common import answers_digest
from training.data import ensure_data
from training.paths import work_dir
from training.teacher import TeacherData, teacher_pass


@dataclass
class AcceptTrainOptions:
    max_depth: int = 8              # drafted depths 1..max_depth
    temperatures: tuple = (0.6, 0.8, 1.0)  # a sampled stream per sequence, at one of these (plus the greedy one)
    keep: float = 0.25              # share of drafted rows kept as examples (all are computed)
    num_blocks: int = 3
    hidden_only: bool = False
    reject_weight: float = 3.0
    steps: int = 3000
    batch: int = 2048
    lr: float = 1e-3
    weight_decay: float = 0.01
    max_len: int = 768
    val_fraction: float = 0.05
    seed: int = 0


@dataclass
class Examples:
    hidden: torch.Tensor   # [N, H] bfloat16
    extra: torch.Tensor    # [N, NUM_EXTRA] float32
    label: torch.Tensor    # [N] float32 in [0, 1]
    greedy: torch.Tensor   # [N] bool
    depth: torch.Tensor    # [N] int
    seq: torch.Tensor      # [N] int: the sequence it came from (held-out split by sequence)


def delayed_rows(model, ids: torch.Tensor, target_kv, delay: int) -> torch.Tensor:
    """The drafter's hidden states [T, H] over the true text ``ids`` [T] when row r sees the target keys before
    r - ``delay``: row r is then the state a token at r + 1 is drafted from at depth ``delay`` + 1 (its root at
    r - delay, the tokens in between accepted)."""
    pos = torch.arange(len(ids), device=ids.device)
    return model(ids, pos, None, 0, target_kv, pos[None, :] < (pos - delay)[:, None])


@torch.inference_mode()
def draft_examples(model, data: TeacherData, opts: AcceptTrainOptions, lm_head: torch.Tensor,
                   progress: bool = True) -> Examples:
    """Every sequence, every depth: the drafted rows' hidden states, the head's other inputs and the labels."""
    dev = model.norm.device
    g = torch.Generator().manual_seed(opts.seed)
    rng = random.Random(opts.seed)
    out: dict[str, list] = {k: [] for k in Examples.__dataclass_fields__}
    vocab_ids = model.vocab_ids.to(dev)
    for i in tqdm(range(len(data)), desc="drafting examples", unit="seq", disable=not progress):
        ids = data.tokens[i].to(dev)
        T, start = len(ids), data.answer_start[i]
        kv = data.kv[i].to(dev, model.norm.dtype)
        target_kv = [(kv[m, 0], kv[m, 1]) for m in range(model.c.num_layers)]
        t_logits = data.hidden[i].to(dev, torch.float32) @ lm_head.t()  # [n, V] the target at rows start..T-2
        t_greedy = t_logits.argmax(-1)
        sp = SamplingParams(temperature=rng.choice(opts.temperatures))
        p_sampled = target_probs(t_logits, sp)                           # [n, V]
        for d in range(1, opts.max_depth + 1):
            first = start + d - 1  # the first row r whose root r + 1 - d is an answer-side position (>= start)
            if first > T - 2:
                break
            h = delayed_rows(model, ids, target_kv, d - 1)[first:T - 1]  # Y_d at r + 1 is drafted from row r
            ql = model.logits(h).float()
            q_greedy = torch.softmax(ql, -1)
            y_greedy = q_greedy.argmax(-1)
            q_s = target_probs(ql, sp)
            y_s = torch.multinomial(q_s, 1, generator=g.manual_seed(opts.seed * 1000003 + i * 97 + d))[:, 0] \
                if dev.type == "cpu" else torch.multinomial(q_s, 1)[:, 0]
            n = len(h)
            tr = torch.arange(first, T - 1, device=dev) - start  # the target's rows for the drafted positions
            lab_g = (vocab_ids[y_greedy] == t_greedy[tr]).float()
            lab_s = (p_sampled[tr, vocab_ids[y_s]] / q_s.gather(1, y_s[:, None])[:, 0]).clamp(max=1.0)
            _collect(out, g, opts, h, torch.full((n,), d, device=dev), lab_g, lab_s,
                     q_greedy.gather(1, y_greedy[:, None])[:, 0], q_s.gather(1, y_s[:, None])[:, 0], sp.temperature, i)
    return Examples(**{k: torch.cat(v) for k, v in out.items()})


@torch.inference_mode()
def falcon_examples(model, data, opts: AcceptTrainOptions, lm_head: torch.Tensor, progress: bool = True) -> Examples:
    """The Falcon chain's examples, depths 1..2k: given acceptance, the first drafted block is the last k verified
    positions with their true inputs (any block of the true stream, its last position the root), and the second is
    the next k positions with their true tokens and the features the first block predicted for them (the two-stream
    pass of CSGD training with every token glanced). Each drafted token's state is the feature row it was drafted
    from."""
    from drafters.falcon.model import block_ids
    from training.falcon_loss import two_stream_mask as falcon_two_stream

    dev, k = model.fuse.device, model.c.k
    g = torch.Generator().manual_seed(opts.seed)
    rng = random.Random(opts.seed)
    out: dict[str, list] = {f: [] for f in Examples.__dataclass_fields__}
    vocab_ids = model.vocab_ids.to(dev)
    for i in tqdm(range(len(data)), desc="drafting examples", unit="seq", disable=not progress):
        tok = data.tokens[i].to(dev)
        feats = data.feats[i].to(dev, model.fuse.dtype)
        T, start = len(tok), data.answer_start[i]
        sp = SamplingParams(temperature=rng.choice(opts.temperatures))
        pos = torch.arange(1, T, device=dev)              # rows: positions 1 .. T-1, inputs (t_p, f_{p-1})
        ids, fin = tok[1:], feats[:-1]
        taps = two_taps = None
        if model.c.taps:  # the target's lower layers at p - 1; none behind the predicted inputs (zeros)
            taps = data.tap_rows(i, model.c.taps)[:-1].to(dev, model.fuse.dtype)
        t_logits_all = feats[start:T - 1].float() @ lm_head.t()  # the target's distribution of positions start+1..
        t_greedy_all, p_all = t_logits_all.argmax(-1), target_probs(t_logits_all, sp)
        for offset in range(k):
            blocks = block_ids(pos, k, offset)
            f1 = model(ids, fin, pos, blocks[None, :] <= blocks[:, None], taps=taps)
            pred = (pos > k).nonzero()[:, 0]              # second-block rows: their inputs were predicted k rows back
            if taps is not None:
                two_taps = torch.cat([taps, torch.zeros_like(taps[pred])])
            two = model(torch.cat([ids, ids[pred]]), torch.cat([fin, f1[pred - k]]), torch.cat([pos, pos[pred]]),
                        falcon_two_stream(blocks, blocks[pred]), taps=two_taps)
            block_end = (blocks + 1) * k - 1 - offset      # the last position of each row's block (its root)
            in_block = pos - (block_end - k + 1)           # 0..k-1
            for stream, rows, depth in ((two[:len(pos)], torch.arange(len(pos), device=dev), in_block + 1),
                                        (two[len(pos):], pred, k + in_block[pred] + 1)):
                root = pos[rows] + k - depth               # the token is at position j + k = root + depth
                label_pos = pos[rows] + k
                ok = (label_pos <= T - 1) & (root >= start) & (depth <= opts.max_depth)
                if not ok.any():
                    continue
                h, tr = stream[ok], label_pos[ok] - 1 - start  # the target's row for the drafted token
                ql = model.logits(h).float()
                q_greedy = torch.softmax(ql, -1)
                y_greedy = q_greedy.argmax(-1)
                q_s = target_probs(ql, sp)
                y_s = torch.multinomial(q_s, 1, generator=g)[:, 0] if dev.type == "cpu" else \
                    torch.multinomial(q_s, 1)[:, 0]
                lab_g = (vocab_ids[y_greedy] == t_greedy_all[tr]).float()
                lab_s = (p_all[tr, vocab_ids[y_s]] / q_s.gather(1, y_s[:, None])[:, 0]).clamp(max=1.0)
                _collect(out, g, opts, h, depth[ok], lab_g, lab_s, q_greedy.gather(1, y_greedy[:, None])[:, 0],
                         q_s.gather(1, y_s[:, None])[:, 0], sp.temperature, i)
    return Examples(**{f: torch.cat(v) for f, v in out.items()})


def _collect(out: dict, g: torch.Generator, opts: AcceptTrainOptions, h: torch.Tensor, depth: torch.Tensor,
             lab_g: torch.Tensor, lab_s: torch.Tensor, conf_g: torch.Tensor, conf_s: torch.Tensor, temperature: float,
             seq: int) -> None:
    """Keep a random ``opts.keep`` share of the greedy and the sampled examples of these rows."""
    n, dev = len(h), h.device
    keep = torch.rand(2 * n, generator=g) < opts.keep
    kd = keep.to(dev)
    temp = torch.cat([torch.zeros(n, device=dev), torch.full((n,), temperature, device=dev)])
    out["hidden"].append(torch.cat([h, h])[kd].to("cpu", torch.bfloat16))
    out["extra"].append(AcceptHead.extra(temp, torch.cat([depth, depth]).to(dev), torch.cat([conf_g, conf_s]))[kd]
                        .cpu())
    out["label"].append(torch.cat([lab_g, lab_s])[kd].float().cpu())
    out["greedy"].append(torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)])[keep])
    out["depth"].append(torch.cat([depth, depth]).cpu()[keep])
    out["seq"].append(torch.full((int(keep.sum()),), seq))


def weighted_bce(logits: torch.Tensor, label: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """The paper's weighted BCE: -(y log P + w (1 - y) log(1 - P)), mean over the batch."""
    return -(label * F.logsigmoid(logits) + reject_weight * (1 - label) * F.logsigmoid(-logits)).mean()


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of binary ``labels`` ranked by ``scores`` (ties counted half)."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    ranks = torch.empty(len(scores))
    order = torch.argsort(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float32)
    # average ranks over ties
    uniq, inv = torch.unique(scores, return_inverse=True)
    mean_rank = torch.zeros(len(uniq)).index_add_(0, inv, ranks) / torch.bincount(inv, minlength=len(uniq))
    r = mean_rank[inv]
    return float((r[labels > 0.5].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def calibration(p: torch.Tensor, label: torch.Tensor, bins: int = 10) -> list[dict]:
    """Predicted vs observed acceptance by bin of predicted probability."""
    out = []
    b = (p * bins).clamp(max=bins - 1).long()
    for k in range(bins):
        m = b == k
        if m.any():
            out.append({"bin": f"{k / bins:.1f}-{(k + 1) / bins:.1f}", "n": int(m.sum()),
                        "predicted": round(float(p[m].mean()), 4), "observed": round(float(label[m].mean()), 4)})
    return out


@torch.no_grad()
def evaluate(head: AcceptHead, ex: Examples, idx: torch.Tensor) -> dict:
    head.eval()
    p = torch.cat([torch.sigmoid(head(ex.hidden[j].float(), ex.extra[j])) for j in idx.split(8192)])
    head.train()
    lab, gr = ex.label[idx], ex.greedy[idx]
    report = {"examples": len(idx)}
    for name, m in (("greedy", gr), ("sampled", ~gr)):
        if m.any():
            report[name] = {"auc": round(auc(p[m], (lab[m] > 0.5).float() if name == "greedy" else
                                             torch.bernoulli(lab[m], generator=torch.Generator().manual_seed(0))), 4),
                            "bce": round(float(F.binary_cross_entropy(p[m].clamp(1e-6, 1 - 1e-6), lab[m])), 4),
                            "mean_label": round(float(lab[m].mean()), 4),
                            "calibration": calibration(p[m], lab[m])}
    return report


def train_head(ex: Examples, opts: AcceptTrainOptions, c: AcceptHeadConfig, progress: bool = True,
               log=print) -> tuple[AcceptHead, dict]:
    torch.manual_seed(opts.seed)
    seqs = ex.seq.unique()
    g = torch.Generator().manual_seed(opts.seed)
    val_seqs = seqs[torch.randperm(len(seqs), generator=g)[:max(1, int(len(seqs) * opts.val_fraction))]]
    is_val = torch.isin(ex.seq, val_seqs)
    tr, va = (~is_val).nonzero()[:, 0], is_val.nonzero()[:, 0]
    head = AcceptHead(c)
    optim = torch.optim.AdamW(head.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=opts.lr, total_steps=opts.steps,
                                                pct_start=max(0.05, 2.5 / opts.steps))
    t0 = time.perf_counter()
    bar = tqdm(range(opts.steps), desc="train accept head", disable=not progress)
    for step in bar:
        j = tr[torch.randint(len(tr), (opts.batch,), generator=g)]
        loss = weighted_bce(head(ex.hidden[j].float(), ex.extra[j]), ex.label[j], opts.reject_weight)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        if step % 100 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
    report = evaluate(head, ex, va)
    report.update(train_examples=len(tr), train_seconds=round(time.perf_counter() - t0, 1))
    log(f"held-out: greedy AUC {report.get('greedy', {}).get('auc')}, sampled AUC "
        f"{report.get('sampled', {}).get('auc')} ({len(va)} examples)")
    return head.eval().requires_grad_(False), report


def run_train_accept_head(cfg, drafter: str = "glide", out: Path | None = None, data_path: Path | None = None,
                          checkpoint: Path | None = None, opts: AcceptTrainOptions | None = None,
                          max_new_tokens: int = 256, gen_batch: int = 64, limit: int | None = None,
                          work: Path | None = None, progress: bool = True, log=print) -> Path:
    """Data -> teacher pass -> drafted examples -> head -> checkpoint + card. Returns the checkpoint path."""
    from server.engine import load_target

    if drafter not in ("glide", "falcon"):
        raise ValueError(f"acceptance heads train for the chain drafters glide and falcon, not {drafter!r}")
    opts = opts or AcceptTrainOptions()
    target = load_target(cfg, progress=progress)
    out = Path(out) if out else default_checkpoint(target.model_id, drafter)
    data_file, items = ensure_data(cfg, target, data_path, max_new_tokens, gen_batch, limit, progress, log)
    wd = Path(work) if work else work_dir(cfg, target.model_id)
    wd.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if drafter == "glide":
        from drafters.glide.drafter import load_glide
        from drafters.glide.model import default_checkpoint as drafter_default

        model = load_glide(target, checkpoint, weights="dense")  # as trained, on any machine
        read = [model.c.target_layer(m) for m in range(model.c.num_layers)]
        layers = "_".join(map(str, read))
        tag = f"{len(items)}+0-{opts.max_len}-{layers}-{str(target.dtype)[6:]}-{answers_digest(items)}"
        teacher_file = wd / f"teacher-{tag}.pt"
        if teacher_file.exists():
            teacher = TeacherData(**torch.load(teacher_file, weights_only=True))
        else:
            teacher = teacher_pass(target, items, read, opts.max_len, progress=progress)
            torch.save(teacher.__dict__, teacher_file)
        hidden, build = model.c.target_hidden, draft_examples
    else:
        from drafters.falcon.drafter import load_falcon
        from drafters.falcon.model import default_checkpoint as drafter_default
        from training.falcon_features import cached_features, features_tag

        model = load_falcon(target, checkpoint, weights="dense")
        feat_file = wd / f"features-{features_tag(items, 0, opts.max_len, target.dtype)}.pt"
        teacher = cached_features(target, items, opts.max_len, feat_file, model.c.taps, progress, log)
        hidden, build = model.c.hidden_size, falcon_examples
    t1 = time.perf_counter()
    ex = build(model, teacher, opts, target.lm_head_weight.float(), progress=progress)
    t2 = time.perf_counter()
    log(f"{len(ex.label)} examples from {len(teacher)} sequences ({t2 - t1:.0f} s); greedy acceptance "
        f"{float(ex.label[ex.greedy].mean()):.3f}, sampled {float(ex.label[~ex.greedy].mean()):.3f}")
    drafter_file = Path(checkpoint) if checkpoint else drafter_default(target.model_id)
    shipped = drafter_file.resolve().parent == (CHECKPOINT_DIR / target.model_id).resolve()
    c = AcceptHeadConfig(target.model_id, drafter, hidden, opts.num_blocks, opts.hidden_only,
                         drafter_checkpoint=drafter_file.name if shipped else "",
                         drafter_digest=checkpoint_digest(drafter_file))
    head, report = train_head(ex, opts, c, progress, log)
    card = {"target": target.model_id, "drafter": drafter, "architecture": asdict(c),
            "data": {"file": data_file.name, "sequences": len(items),
                     "answer_tokens": sum(len(i["response_ids"]) for i in items), "examples": len(ex.label)},
            "training": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(opts).items()},
                         "teacher_seconds": round(t1 - t0, 1), "drafting_seconds": round(t2 - t1, 1)},
            "validation": report}
    head.save(out, card)
    log(f"wrote {out} and {out.with_suffix('.json')}")
    return out
