"""`specserve bench offline`: every named drafter (and `none`) on the same prompts, in one process.

Greedy decoding by default; ``--temperature`` / ``--top-p`` / ``--seed`` time sampled requests the same way (with a
seed, prompt i is seeded ``seed + i`` and outputs must still equal `none`'s; without one they cannot be compared). A
drafter spec may override its config options, ``name:key=value:key=value`` (values read as YAML, e.g.
``glide:gamma=3`` or ``falcon:top_m=[2,1]``), so one run can sweep a drafter's settings. For each drafter: tokens/s
(generated tokens / generation wall time, prefill included), mean accepted length (tokens per target forward, bonus
included), acceptance rate, speedup vs `none`, and whether every output equals `none`'s token for token.
`--baseline hf` also times transformers' `generate(do_sample=False)` on the same weights, dtype and prompts. Runs
are interleaved (repeat -> prompt -> drafter) so machine noise hits every drafter alike; tokens/s is the median over
repeats.

Hardware-independent numbers (Cascade Speculative Drafting's standardized walltime improvement): the counts of
target forwards (prefills + verify steps) and drafter forwards (from the drafter's ``num_forwards`` counter; 0 for
drafters that run no model), the cost coefficient c = mean drafter forward time / mean target forward time (the
`none` engine's verify forwards) measured on this machine, and SWI = generated tokens / (target forwards +
drafter forwards * c). Counts come from the first repeat, times from all of them.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import yaml

from core.grammar import response_format_grammar
from core.sampling import SamplingParams
from drafters.base import create_drafter
from server.config import EngineConfig
from server.engine import Engine, load_target
from server.model_files import load_tokenizer
from server.tokenization import encode_record, read_prompts, stop_token_ids


def _hf_generate(hf_model, prompt_ids: list[int], max_tokens: int, stop_ids: tuple[int, ...]) -> tuple[list[int], float]:
    x = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=list(stop_ids), pad_token_id=stop_ids[0], temperature=None,
                                top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0


def parse_specs(text: str) -> list[tuple[str, str, dict]]:
    """``"glide:gamma=2,falcon:top_m=[2,1]"`` -> [(label, drafter name, option overrides)]; commas inside brackets
    do not split specs."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    specs = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        name, *pairs = part.split(":")
        overrides = {}
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"drafter spec {part!r}: expected name:key=value[:key=value...]")
            overrides[key.strip()] = yaml.safe_load(value)
        specs.append((part, name.strip(), overrides))
    return specs


def _drafter_counters(drafter) -> tuple[int, float]:
    """(forwards, seconds) of the drafter's model so far; (0, 0.0) for drafters without a model."""
    return getattr(drafter, "num_forwards", 0), getattr(drafter, "forward_seconds", 0.0)


def run_offline(cfg: EngineConfig, drafters: list[str], prompts_path: str, max_tokens: int,
                baseline: str | None = None, repeats: int = 1, log=print,
                sampling: SamplingParams | None = None, grammar: bool = True, free_baseline: bool = False) -> dict:
    """``grammar``: constrain each prompt by its record's response_format; ``free_baseline``: also time `none` on
    the same prompts without it (the row ``none-free``), in the same interleaved run."""
    specs = {label: (name, opts) for label, name, opts in parse_specs(",".join(drafters))}
    specs.pop("none", None)
    names = ["none", *specs]
    sampling = sampling or SamplingParams()
    comparable = sampling.greedy or sampling.seed is not None
    if baseline and (not sampling.greedy or sampling.shaped):
        raise ValueError("--baseline hf times plain greedy decoding; drop it for sampled or penalised runs")
    target = load_target(cfg)
    tok = load_tokenizer(target.hf_dir)
    stops = stop_token_ids(tok, target.args.eos_token_ids)
    records = read_prompts(prompts_path)
    prompts = [encode_record(tok, r) for r in records]
    # a record's response_format constrains its output (grammar False: the same prompts unconstrained)
    formats = [response_format_grammar(r.get("response_format")) if grammar else (None, None) for r in records]
    engines = {"none": Engine(cfg, create_drafter("none", target), target)}
    if free_baseline:
        engines[FREE] = Engine(cfg, create_drafter("none", target), target)
        names.insert(1, FREE)
    for label, (name, opts) in specs.items():
        engines[label] = Engine(cfg, create_drafter(name, target, {**cfg.drafter.options_for(name), **opts}), target)
    hf_model = None
    if baseline == "hf":
        from server.model_files import hf_causal_lm
        hf_model = hf_causal_lm(target.hf_dir, target.gguf, target.dtype)
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
                sp = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i)
                if formats[i][0] is not None and n != FREE:
                    sp = dataclasses.replace(sp, grammar=formats[i][0])
                out = eng.generate(ids, sp, max_new_tokens=max_tokens, stop_token_ids=stops)
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
              "quantization": target.quantization, "device": str(target.device),
              "threads": torch.get_num_threads(), "prompts": len(prompts), "max_tokens": max_tokens,
              "repeats": repeats, "temperature": sampling.temperature, "top_p": sampling.top_p,
              "seed": sampling.seed, "min_p": sampling.min_p, "presence_penalty": sampling.presence_penalty,
              "frequency_penalty": sampling.frequency_penalty, "repetition_penalty": sampling.repetition_penalty,
              "constrained": sum(g is not None for g, _ in formats), "results": []}
    target_s = timing["none"][1] / max(1, timing["none"][0])  # one target forward (a decode step)
    report["target_forward_ms"] = round(1000 * target_s, 4)
    for n in names:
        v, st, dr, ac = steps[n]
        same = [a == b for a, b in zip(outputs[n], outputs["none"])]
        free = n == FREE  # other outputs by design
        _, _, d_fwd, d_s = timing[n]
        drafter_s = d_s / d_fwd if d_fwd else 0.0
        c = drafter_s / target_s if target_s > 0 else 0.0
        report["results"].append({
            "drafter": n, "tokens_per_s": round(tps[n], 3),
            "mean_accepted_length": round(st / v, 4) if v else 0.0,
            "acceptance_rate": round(ac / dr, 4) if dr else 0.0,
            "target_forwards": v + len(prompts), "draft_tokens": dr, "accepted_tokens": ac,
            "speedup_vs_none": round(tps[n] / tps["none"], 3),
            "lossless": all(same) if comparable and not free else None,
            "lossless_fraction": sum(same) / len(same) if comparable and not free else None,
            "drafter_forwards": drafter_forwards[n], "drafter_forward_ms": round(1000 * drafter_s, 4),
            "cost_coefficient": round(c, 4),
            "swi": round(toks[n][0] / (v + len(prompts) + drafter_forwards[n] * c), 4),
            "outputs": outputs[n],
        })
        if report["constrained"] and not free:
            report["results"][-1]["valid_fraction"] = _valid_fraction(tok, outputs[n], formats)
    if hf_model is not None:
        hf_tps = statistics.median(t / s for t, s in zip(hf_toks, hf_secs))
        report["baseline_hf"] = {"tokens_per_s": round(hf_tps, 3), "outputs": hf_out,
                                 "matches_none_fraction": sum(a == b for a, b in zip(hf_out, outputs["none"]))
                                 / len(prompts)}
        for row in report["results"]:
            row["speedup_vs_hf"] = round(row["tokens_per_s"] / hf_tps, 3)
    return report


FREE = "none-free"  # `none` on the same prompts without their response_format (``free_baseline``)


def _valid_fraction(tok, outputs: list[list[int]], formats) -> float:
    """The share of constrained outputs that parse as JSON and validate against their schema."""
    import json

    import jsonschema

    ok = n = 0
    for ids, (g, schema) in zip(outputs, formats):
        if g is None:
            continue
        n += 1
        try:
            jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), schema)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok / n


def format_report(rep: dict) -> str:
    w = max(14, 2 + max(len(r["drafter"]) for r in rep["results"]))
    sampled = "greedy" if not rep.get("temperature") else \
        f"temperature {rep['temperature']}  top_p {rep['top_p']}  seed {rep['seed']}"
    shaping = [f"{k} {rep[k]}" for k, off in (("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                              ("repetition_penalty", 1.0)) if rep.get(k, off) != off]
    sampled = "  ".join([sampled, *shaping])
    lines = [f"model {rep['model']}  dtype {rep['dtype']}  quantization {rep['quantization']}  "
             f"device {rep['device']}  threads {rep['threads']}  prompts {rep['prompts']}  "
             f"max_tokens {rep['max_tokens']}  repeats {rep['repeats']}  {sampled}",
             f"{'drafter':<{w}}{'tok/s':>9}{'accept_len':>12}{'accept_rate':>13}{'vs none':>9}{'vs hf':>8}"
             f"{'lossless':>10}{'tgt_fwd':>9}{'drf_fwd':>9}{'c':>8}{'SWI':>7}"]
    for r in rep["results"]:
        vs_hf = f"{r['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in r else "-"
        lossless = "-" if r["lossless"] is None else "yes" if r["lossless"] else \
            "NO (%.0f%%)" % (100 * r["lossless_fraction"])
        lines.append(f"{r['drafter']:<{w}}{r['tokens_per_s']:>9.2f}{r['mean_accepted_length']:>12.2f}"
                     f"{r['acceptance_rate']:>13.2f}{r['speedup_vs_none']:>8.2f}x{vs_hf:>8}"
                     f"{lossless:>10}"
                     f"{r['target_forwards']:>9}{r['drafter_forwards']:>9}{r['cost_coefficient']:>8.3f}"
                     f"{r['swi']:>7.2f}" + (f"{100 * r['valid_fraction']:>8.0f}%" if "valid_fraction" in r else ""))
    if rep.get("constrained"):
        lines[1] += f"{'valid':>9}"
        lines[0] += f"  constrained {rep['constrained']} (response_format)"
    lines.append(f"c = drafter forward time / target forward time ({rep['target_forward_ms']:.2f} ms here); "
                 "SWI = tokens / (tgt_fwd + drf_fwd * c)")
    if "baseline_hf" in rep:
        b = rep["baseline_hf"]
        lines.append(f"{'hf generate':<{w}}{b['tokens_per_s']:>9.2f}   (outputs equal none's on "
                     f"{100 * b['matches_none_fraction']:.0f}% of prompts)")
    return "\n".join(lines)
