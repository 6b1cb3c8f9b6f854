"""`specserve bench offline`: every named drafter (and `none`) on the same prompts, in one process.

Greedy decoding. For each drafter: tokens/s (generated tokens / generation wall time, prefill included), mean
accepted length (tokens per target forward, bonus included), acceptance rate, speedup vs `none`, and whether every
output equals `none`'s token for token. `--baseline hf` also times transformers' `generate(do_sample=False)` on the
same weights, dtype and prompts. Runs are interleaved (repeat -> prompt -> drafter) so machine noise hits every
drafter alike; tokens/s is the median over repeats.

Hardware-independent numbers (Cascade Speculative Drafting's standardized walltime improvement): the counts of
target forwards (prefills + verify steps) and drafter forwards (from the drafter's ``num_forwards`` counter; 0 for
drafters that run no model), the cost coefficient c = mean drafter forward time / mean target forward time (the
`none` engine's verify forwards) measured on this machine, and SWI = generated tokens / (target forwards +
drafter forwards * c). Counts come from the first repeat, times from all of them.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from drafters.base import create_drafter
from server.config import EngineConfig
from server.engine.engine import Engine, load_target
from server.engine.weights import load_tokenizer
from server.tokenization import encode_record, stop_token_ids


def read_prompts(path: str | Path) -> list[dict]:
    records = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if line.strip():
            rec = json.loads(line)
            if "messages" not in rec and "prompt" not in rec:
                raise ValueError(f"{path}:{i + 1}: each line needs `messages` or `prompt`")
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


def _hf_generate(hf_model, prompt_ids: list[int], max_tokens: int, stop_ids: tuple[int, ...]) -> tuple[list[int], float]:
    x = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=list(stop_ids), pad_token_id=stop_ids[0], temperature=None,
                                top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0


def _drafter_counters(drafter) -> tuple[int, float]:
    """(forwards, seconds) of the drafter's model so far; (0, 0.0) for drafters without a model."""
    return getattr(drafter, "num_forwards", 0), getattr(drafter, "forward_seconds", 0.0)


def run_offline(cfg: EngineConfig, drafters: list[str], prompts_path: str, max_tokens: int,
                baseline: str | None = None, repeats: int = 1, log=print) -> dict:
    names = ["none"] + [d for d in dict.fromkeys(drafters) if d != "none"]
    target = load_target(cfg)
    tok = load_tokenizer(target.hf_dir)
    stops = stop_token_ids(tok, target.args.eos_token_ids)
    prompts = [encode_record(tok, r) for r in read_prompts(prompts_path)]
    engines = {n: Engine(cfg, create_drafter(n, target, cfg.drafter.options_for(n)), target) for n in names}
    hf_model = None
    if baseline == "hf":
        from transformers import AutoModelForCausalLM
        hf_model = AutoModelForCausalLM.from_pretrained(str(target.hf_dir), dtype=target.dtype).eval()
    elif baseline:
        raise ValueError(f"unknown baseline {baseline!r} (supported: hf)")

    # Warm-up: first calls pay one-off allocation and dispatch costs.
    for eng in engines.values():
        eng.generate(prompts[0][:16], max_new_tokens=4)
    if hf_model is not None:
        _hf_generate(hf_model, prompts[0][:16], 4, stops)

    outputs = {n: [None] * len(prompts) for n in names}
    secs = {n: [0.0] * repeats for n in names}
    toks = {n: [0] * repeats for n in names}
    steps = {n: [0, 0, 0, 0] for n in names}  # verify steps, step tokens, draft tokens, accepted tokens
    drafter_forwards = {n: 0 for n in names}        # first repeat
    timing = {n: [0, 0.0, 0, 0.0] for n in names}  # all repeats: verify steps, verify s, drafter forwards, drafter s
    hf_out, hf_secs, hf_toks = [None] * len(prompts), [0.0] * repeats, [0] * repeats
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            for n, eng in engines.items():
                f0, d0 = _drafter_counters(eng.drafter)
                out = eng.generate(ids, max_new_tokens=max_tokens, stop_token_ids=stops)
                f1, d1 = _drafter_counters(eng.drafter)
                secs[n][r] += out.prefill_s + out.decode_s
                toks[n][r] += len(out.token_ids)
                t = timing[n]
                t[0] += out.stats.verify_steps
                t[1] += out.stats.verify_seconds
                t[2] += f1 - f0
                t[3] += d1 - d0
                if r == 0:
                    drafter_forwards[n] += f1 - f0
                    outputs[n][i] = out.token_ids
                    s = out.stats
                    for j, v in enumerate((s.verify_steps, s.step_tokens, s.draft_tokens, s.accepted_tokens)):
                        steps[n][j] += v
            if hf_model is not None:
                ids_hf, dt = _hf_generate(hf_model, ids, max_tokens, stops)
                hf_secs[r] += dt
                hf_toks[r] += len(ids_hf)
                if r == 0:
                    hf_out[i] = ids_hf
        log(f"repeat {r + 1}/{repeats} done")

    tps = {n: statistics.median(t / s for t, s in zip(toks[n], secs[n])) for n in names}
    report = {"model": target.model_id, "dtype": str(target.dtype).removeprefix("torch."),
              "quantization": cfg.model.quantization, "device": str(target.device),
              "threads": torch.get_num_threads(), "prompts": len(prompts), "max_tokens": max_tokens,
              "repeats": repeats, "results": []}
    target_s = timing["none"][1] / max(1, timing["none"][0])  # one target forward (a decode step)
    report["target_forward_ms"] = round(1000 * target_s, 4)
    for n in names:
        v, st, dr, ac = steps[n]
        same = [a == b for a, b in zip(outputs[n], outputs["none"])]
        _, _, d_fwd, d_s = timing[n]
        drafter_s = d_s / d_fwd if d_fwd else 0.0
        c = drafter_s / target_s if target_s > 0 else 0.0
        report["results"].append({
            "drafter": n, "tokens_per_s": round(tps[n], 3),
            "mean_accepted_length": round(st / v, 4) if v else 0.0,
            "acceptance_rate": round(ac / dr, 4) if dr else 0.0,
            "target_forwards": v + len(prompts), "draft_tokens": dr, "accepted_tokens": ac,
            "speedup_vs_none": round(tps[n] / tps["none"], 3),
            "lossless": all(same), "lossless_fraction": sum(same) / len(same),
            "drafter_forwards": drafter_forwards[n], "drafter_forward_ms": round(1000 * drafter_s, 4),
            "cost_coefficient": round(c, 4),
            "swi": round(toks[n][0] / (v + len(prompts) + drafter_forwards[n] * c), 4),
            "outputs": outputs[n],
        })
    if hf_model is not None:
        hf_tps = statistics.median(t / s for t, s in zip(hf_toks, hf_secs))
        report["baseline_hf"] = {"tokens_per_s": round(hf_tps, 3), "outputs": hf_out,
                                 "matches_none_fraction": sum(a == b for a, b in zip(hf_out, outputs["none"]))
                                 / len(prompts)}
        for row in report["results"]:
            row["speedup_vs_hf"] = round(row["tokens_per_s"] / hf_tps, 3)
    return report


def format_report(rep: dict) -> str:
    lines = [f"model {rep['model']}  dtype {rep['dtype']}  quantization {rep['quantization']}  "
             f"device {rep['device']}  threads {rep['threads']}  prompts {rep['prompts']}  "
             f"max_tokens {rep['max_tokens']}  repeats {rep['repeats']}",
             f"{'drafter':<14}{'tok/s':>9}{'accept_len':>12}{'accept_rate':>13}{'vs none':>9}{'vs hf':>8}"
             f"{'lossless':>10}{'tgt_fwd':>9}{'drf_fwd':>9}{'c':>8}{'SWI':>7}"]
    for r in rep["results"]:
        vs_hf = f"{r['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in r else "-"
        lines.append(f"{r['drafter']:<14}{r['tokens_per_s']:>9.2f}{r['mean_accepted_length']:>12.2f}"
                     f"{r['acceptance_rate']:>13.2f}{r['speedup_vs_none']:>8.2f}x{vs_hf:>8}"
                     f"{'yes' if r['lossless'] else 'NO (%.0f%%)' % (100 * r['lossless_fraction']):>10}"
                     f"{r['target_forwards']:>9}{r['drafter_forwards']:>9}{r['cost_coefficient']:>8.3f}"
                     f"{r['swi']:>7.2f}")
    lines.append(f"c = drafter forward time / target forward time ({rep['target_forward_ms']:.2f} ms here); "
                 "SWI = tokens / (tgt_fwd + drf_fwd * c)")
    if "baseline_hf" in rep:
        b = rep["baseline_hf"]
        lines.append(f"{'hf generate':<14}{b['tokens_per_s']:>9.2f}   (outputs equal none's on "
                     f"{100 * b['matches_none_fraction']:.0f}% of prompts)")
    return "\n".join(lines)
