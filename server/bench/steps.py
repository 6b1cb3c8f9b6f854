"""`specserve bench steps`: the step-cost curve, ms per target forward against the number of rows it verifies.

Speculation pays only where verifying k draft rows costs little more than decoding one, so this is the first figure
to read on a new machine: T(k) / T(1) for k = 1, 2, 4, ... 64 rows of a chain after ``cached`` tokens, median of
``repeats`` forwards, for each serving dtype (and weight quantization) asked for, in one process. ``profile`` adds
torch.profiler's top operators for a decode step (1 row) and a k-row verify.
"""
from __future__ import annotations

import dataclasses

import torch

from server.config import EngineConfig
from server.engine import Engine, load_target
from server.engine.stepcost import step_curve

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64)


def profile_step(engine: Engine, rows: int, cached: int = 300, forwards: int = 10, top: int = 12) -> str:
    """torch.profiler's table of the top operators (by self CPU time) over ``forwards`` verifies of ``rows`` rows
    (the prefill and warm-up forwards before them are not profiled)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    prof = profile(activities=acts)
    try:
        step_curve(engine, (rows,), cached, repeats=forwards, on_ready=prof.__enter__)
    finally:
        prof.__exit__(None, None, None)
    return (f"{forwards} forwards; per forward divide by {forwards}\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def run_steps(cfg: EngineConfig, dtypes: list[str], quantizations: list[str], rows=DEFAULT_ROWS, cached: int = 300,
              repeats: int = 7, profile_rows: int | None = None, log=print) -> dict:
    report = {"threads": torch.get_num_threads(), "cached": cached, "repeats": repeats, "curves": []}
    for dtype in dtypes:
        for quant in quantizations:
            c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype, quantization=quant),
                                    cache=dataclasses.replace(cfg.cache, num_slots=1,
                                                              max_seq_len=max(cfg.cache.max_seq_len,
                                                                              cached + max(rows) + 1)),
                                    drafter=dataclasses.replace(cfg.drafter, name="none"))
            c.validate()
            target = load_target(c, progress=False)
            engine = Engine(c, target=target)
            curve = step_curve(engine, tuple(rows), cached, repeats)
            entry = {"dtype": str(target.dtype).removeprefix("torch."), "quantization": target.quantization,
                     "device": str(target.device), "ms": {str(k): round(v, 3) for k, v in curve.items()}}
            if profile_rows:
                entry["profile"] = {str(r): profile_step(engine, r, cached) for r in sorted({1, profile_rows})}
            report["curves"].append(entry)
            log(f"{entry['dtype']} {entry['quantization']}: " + " ".join(f"{k}:{v:.1f}" for k, v in curve.items()))
            del engine, target
    return report


def format_steps(rep: dict) -> str:
    rows = list(rep["curves"][0]["ms"]) if rep["curves"] else []
    lines = [f"step cost: ms per target forward vs rows verified (chain after {rep['cached']} cached tokens, median "
             f"of {rep['repeats']}, {rep['threads']} threads); in brackets T(rows) / T(1)",
             f"{'dtype':<10}{'quant':<7}{'device':<8}" + "".join(f"{r:>15}" for r in rows)]
    for c in rep["curves"]:
        t1 = c["ms"][rows[0]]
        cells = "".join(f"{c['ms'][r]:>8.2f} ({c['ms'][r] / t1:.2f})" for r in rows)
        lines.append(f"{c['dtype']:<10}{c['quantization']:<7}{c['device']:<8}{cells}")
    for c in rep["curves"]:
        for r, table in c.get("profile", {}).items():
            lines += ["", f"top operators, {c['dtype']} {c['quantization']}, {r} row(s):", table]
    return "\n".join(lines)
