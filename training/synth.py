"""Training prompts written by the target itself: ``specserve train prompts`` (the Magpie method, arXiv 2406.08464).

No dataset can be downloaded here, and the hand-written prompts (training/prompts.py) are a thousand. But the
target is an instruct model: fed its chat template up to the start of a user turn, it writes a user turn, because that
is what follows in the conversations it was tuned on. Sampling that turn until the end-of-turn token gives prompts in
the target's own idea of what users ask, which is the traffic a drafter will see. The prefix comes from the
tokenizer's chat template (a placeholder user message is rendered and cut), so another chat model works unchanged.

Steering: a system message per category (coding, math, writing, advice, explanation, extraction/summarisation, plus
the template's default one), half of them with a topic hint drawn from prompts.py's lists, so every kind of request
appears. A share of the jobs becomes multi-turn: the target answers the first turn (greedy) and writes a follow-up
user turn after its own answer the same way, so drafters see longer contexts.

A small model writes much that is unusable, so filters drop what is empty, truncated (no end-of-turn before the token
cap), degenerate (repeated n-grams, few distinct words, mostly non-text, an answer instead of a question, a copy of
the system message), too short or too long; then exact duplicates (normalised text), near duplicates (MinHash over
word 3-grams with LSH banding, confirmed by exact Jaccard) and anything overlapping the benchmark prompts in
deploy/prompts/ are dropped. A deterministic held-out split (by a hash of the text) is kept apart.

Every job is seeded by (seed, index, turn): the engine draws a seeded token by a race keyed on (seed, position), so a
run is a function of its settings. Generation goes in shards of consecutive job indices, each written atomically when
done; a killed run continues at the first missing shard, and since a shard never depends on another, a resumed run
gives the very same prompts as an uninterrupted one. Filtering runs over the shards in index order, so it is
deterministic too (and a changed filter re-selects from the shards without generating again); generation stops once
``count`` prompts survive.

Output under ``<cache>/train/<target>/synth/``: ``train.jsonl`` and ``heldout.jsonl`` (one ``{"messages",
"category", "source": "synth", "index"}`` per line), ``stats.json`` (counts per category, rejections per reason with
examples, throughput), ``plan.json`` (the settings the shards were made with) and ``shards/``.

The steering, the settings and the jobs are in training/synth_jobs.py, the text filters in
training/prompt_filters.py, deduplication and the benchmark guard in training/prompt_dedup.py and the selection over
the jobs in training/synth_selection.py; this module runs the pipeline and writes its output.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from training.batched_generator import BatchedGenerator
from training.common import stable_int, stable_unit
from training.prompt_filters import FilterConfig, normalize
from training.synth_jobs import CATEGORIES, SynthSettings, Templates, job_plan, synth_job
from training.synth_selection import Selection


def is_heldout(text: str, fraction: float) -> bool:
    """A fixed function of the normalised first user turn (a prompt lands in the same split whatever the run)."""
    return stable_unit("heldout", normalize(text)) < fraction


# -- the pipeline ----------------------------------------------------------------------------------------------------
def _check_plan(out: Path, plan: dict) -> None:
    path = out / "plan.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != plan:
            diff = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
            raise ValueError(f"{out} holds shards made with other settings ({', '.join(diff)} differ); pass another "
                             "--out or delete it")
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan, indent=1) + "\n")


def _categories_digest() -> int:
    return stable_int(json.dumps([asdict(c) for c in CATEGORIES]))


def synthesize_prompts(cfg, target, out: Path, settings: SynthSettings | None = None, batch: int = 64,
                       step_tokens: int = 512, filters: FilterConfig | None = None, max_shards: int | None = None,
                       progress: bool = True, log=print, command: str | None = None) -> dict:
    """Generate (resumably, by shards), filter and deduplicate until ``settings.count`` prompts survive; write the
    train and held-out JSONL files and the stats. Returns the stats (``complete`` False when ``max_shards`` stopped
    the run first)."""
    from server.model_files import load_tokenizer

    s, filters, out = settings or SynthSettings(), filters or FilterConfig(), Path(out)
    tpl = Templates(load_tokenizer(target.hf_dir), target.args.eos_token_ids)
    _check_plan(out, {"model_id": target.model_id, "dtype": str(target.dtype), **s.generation_key(),
                      "categories": _categories_digest()})
    (out / "shards").mkdir(parents=True, exist_ok=True)
    run = _Run(Selection(filters), s)
    k = 0
    while run.wants_more(k) and (out / "shards" / f"raw-{k:05d}.json").exists():  # resume: what is done
        run.feed(json.loads((out / "shards" / f"raw-{k:05d}.json").read_text()))
        k += 1
    if k:
        log(f"resumed: {k} shards ({run.jobs} jobs, {len(run.sel.kept)} prompts kept) already in {out / 'shards'}")
    gen, new_shards = None, 0
    bar = tqdm(total=run.estimate(), initial=run.jobs, desc="synth prompts", unit="prompt", disable=not progress,
               smoothing=0.05)
    t0, run_tokens = time.perf_counter(), 0

    def on_step(n_tok: int, finished: int) -> None:
        nonlocal run_tokens
        run_tokens += n_tok
        bar.update(finished)
        bar.set_postfix(kept=len(run.sel.kept), tok_s=f"{run_tokens / (time.perf_counter() - t0):.0f}", refresh=False)

    while run.wants_more(k):
        path = out / "shards" / f"raw-{k:05d}.json"
        if path.exists():
            shard = json.loads(path.read_text())
        elif max_shards is not None and new_shards >= max_shards:
            break
        else:
            if gen is None:
                longest = max(len(tpl.user_prefix(c.hinted or c.system, [])) for c in CATEGORIES) + 64
                gen = BatchedGenerator(cfg, target, batch, longest + 2 * s.max_prompt_tokens + s.max_answer_tokens,
                                       step_tokens)
            shard = _generate_shard(gen, k, s, tpl, on_step)
            _write_atomic(path, json.dumps(shard))
            new_shards += 1
        run.feed(shard)
        k += 1
        _write_atomic(out / "stats.json", json.dumps(_stats(run, target, command, False), indent=1) + "\n")
        bar.total = run.estimate()
        bar.n = run.jobs
        bar.set_postfix(kept=len(run.sel.kept), tok_s=f"{run_tokens / max(1e-9, time.perf_counter() - t0):.0f}")
    bar.close()
    complete = not run.wants_more(k)
    stats = _stats(run, target, command, complete)
    if complete:
        if len(run.sel.kept) < s.count:
            log(f"only {len(run.sel.kept)} of {s.count} prompts survived the filters after {run.sel.generated} "
                "generated (raise --max-generated)")
        _write_outputs(out, run.sel.kept, s)
    _write_atomic(out / "stats.json", json.dumps(stats, indent=1) + "\n")
    return stats


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@dataclass
class _Run:
    """The shards fed so far: selection state and throughput totals."""

    sel: Selection
    s: SynthSettings
    jobs: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def wants_more(self, next_shard: int) -> bool:
        return len(self.sel.kept) < self.s.count and next_shard * self.s.shard_size < self.s.limit

    def feed(self, shard: dict) -> None:
        self.jobs += len(shard["jobs"])
        self.tokens += shard["tokens"]
        self.seconds += shard["seconds"]
        for raw in shard["jobs"]:
            if len(self.sel.kept) < self.s.count and raw["index"] < self.s.limit:
                self.sel.add(raw)

    def estimate(self) -> int:
        """Jobs likely needed in all, at the acceptance seen so far."""
        if not self.sel.kept:  # before any evidence: about two thirds survive
            return min(self.s.limit, max(self.jobs, round(1.5 * self.s.count)))
        rate = len(self.sel.kept) / self.sel.generated
        return min(self.s.limit, self.jobs + round((self.s.count - len(self.sel.kept)) / rate))


def _generate_shard(gen: BatchedGenerator, k: int, s: SynthSettings, tpl: Templates, on_step) -> dict:
    """Jobs [k * shard_size, (k + 1) * shard_size): always the whole range, so a shard never depends on the limit."""
    t0 = time.perf_counter()
    plans = [job_plan(i, s) for i in range(k * s.shard_size, (k + 1) * s.shard_size)]
    # Multi-turn jobs (three generations in a row) start first, so the shard's tail, when the batch runs half empty,
    # holds only short single-turn jobs. Every job is seeded on its own: the order changes no result.
    order = sorted(range(len(plans)), key=lambda j: not plans[j]["multi_turn"])
    done = gen.run([synth_job(plans[j], s, tpl) for j in order], on_step)
    raws = [None] * len(plans)
    for j, r in zip(order, done):
        raws[j] = r
    return {"shard": k, "seconds": round(time.perf_counter() - t0, 3), "tokens": sum(r["tokens"] for r in raws),
            "jobs": raws}


def _write_outputs(out: Path, kept: list[dict], s: SynthSettings) -> None:
    train, held = [], []
    for rec in kept:
        (held if is_heldout(rec["messages"][0]["content"], s.heldout_fraction) else train).append(rec)
    for name, recs in (("train.jsonl", train), ("heldout.jsonl", held)):
        _write_atomic(out / name, "".join(json.dumps(r) + "\n" for r in recs))


def _stats(run: _Run, target, command: str | None, complete: bool) -> dict:
    sel, s = run.sel, run.s
    by_cat: dict[str, int] = {}
    for rec in sel.kept:
        by_cat[rec["category"]] = by_cat.get(rec["category"], 0) + 1
    held = sum(is_heldout(r["messages"][0]["content"], s.heldout_fraction) for r in sel.kept)
    n, g = max(1, len(sel.kept)), max(1, sel.generated)
    rejected = sorted(sel.rejected.items(), key=lambda kv: (-kv[1], kv[0]))
    return {
        "model_id": target.model_id, "dtype": str(target.dtype).removeprefix("torch."), "command": command,
        "complete": complete, "settings": asdict(s), "generated": sel.generated, "kept": len(sel.kept),
        "train": len(sel.kept) - held, "heldout": held, "acceptance": round(len(sel.kept) / g, 4),
        "multi_turn": sum(len(r["messages"]) > 1 for r in sel.kept),
        "by_category": dict(sorted(by_cat.items())),
        "category_shares": {c: round(v / n, 4) for c, v in sorted(by_cat.items())},
        "generated_by_category": dict(sorted(sel.generated_by_category.items())),
        "rejected": dict(rejected), "rejected_share": {r: round(v / g, 4) for r, v in rejected},
        "multi_turn_fallbacks": dict(sorted(sel.fallbacks.items())),
        "rejected_examples": {r: sel.examples[r] for r, _ in rejected},
        "fallback_examples": {r: sel.examples[r] for r in sorted(sel.fallbacks)},
        "generation": {"jobs": run.jobs, "tokens": run.tokens, "seconds": round(run.seconds, 1),
                       "prompts_per_s": round(run.jobs / max(1e-9, run.seconds), 3),
                       "tokens_per_s": round(run.tokens / max(1e-9, run.seconds), 1)},
        "filter_seconds": round(sel.seconds, 2),
    }


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
