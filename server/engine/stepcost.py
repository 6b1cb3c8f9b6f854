"""The step-cost curve T(rows) (ms per target forward against the rows it verifies) and the serving dtype it picks.

Machines differ: on a CPU with AMX (and on GPUs) bfloat16 is the fast dtype, on CPUs without it float32 can be twice
as fast; a constant tuned on one machine is wrong on the next. ``model.dtype: auto`` therefore measures the target on
the machine at start-up (a decode step and an 8-row verify, for each candidate dtype), serves the fastest, and caches
the choice next to the converted weights, keyed by what it depends on (CPU model and features, torch version,
threads, quantization), so later starts on the same machine skip the measurement.
"""
from __future__ import annotations

import bisect
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from core.ops import linear_key, measure_int4_forms, measure_linear_kernels, use_linear_kernel
from core.tree import MAX_TREE_ROWS, DraftTree
from specserve_kernels.cpu import cpu_flags, cpu_model
from server.engine.step import StepPlan

log = logging.getLogger("specserve.engine")

AUTO_CANDIDATES = ("bfloat16", "float32")  # float16 matmuls have no fast CPU path here; CUDA takes bfloat16 directly
AUTO_ROWS = (1, 8)  # the dtype is scored by T(1) + T(8): plain decoding and a typical draft verify, alike
CHOICE_FILE = "serving-dtype.json"
KERNELS_FILE = "linear-kernels.json"
COSTS_FILE = "step-cost.json"
BUDGET_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the step-cost curve the draft budget interpolates


def step_curve(engine, rows: tuple[int, ...], cached: int = 300, repeats: int = 7, seed: int = 0,
               on_ready: Callable[[], None] | None = None) -> dict[int, float]:
    """{rows: median ms of one ``engine.verify`` (an ``Engine``) over a chain of that many rows after ``cached`` cached tokens}.

    Nothing is committed: every forward writes the same cache rows past the prefix, as a rejected draft would.
    ``on_ready`` runs once the prefix is cached, before the first timed forward (a profiler starts there).
    """
    g = torch.Generator().manual_seed(seed)
    V = engine.target.args.vocab_size
    need = cached + max(rows) + 1
    if need > engine.max_seq_len:
        raise ValueError(f"the context ({engine.max_seq_len}) is below the {need} positions the curve needs")
    prompt = torch.randint(V, (cached + 1,), generator=g).tolist()  # the last one is the next root
    seq = engine.add(prompt, max_new_tokens=engine.max_seq_len - len(prompt))
    try:
        engine.run(StepPlan(prefill=[(seq, cached)]))  # the prefix is cached; the root stays for the trees
        trees = {k: DraftTree.chain(prompt[-1], torch.randint(V, (k - 1,), generator=g).tolist()) for k in rows}

        def forward(tree: DraftTree) -> None:
            if tree.num_rows <= MAX_TREE_ROWS:
                engine.verify(seq, tree)
            else:  # past one tree's rows: causal rows, as a batch of several sequences' rows would cost
                engine.logits(engine.forward(seq, tree.tokens))

        for tree in trees.values():  # two warm-up forwards per shape
            forward(tree)
            forward(tree)
        if on_ready is not None:
            on_ready()
        out = {}
        for k, tree in trees.items():
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                forward(tree)
                if engine.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out[k] = 1000 * statistics.median(times)
        return out
    finally:
        engine.release(seq, cache=False)


def step_costs(engine, max_rows: int, cache_dir: Path | None) -> dict[int, float]:
    """The step-cost curve {total rows: ms} for the draft budget, up to ``max_rows`` rows (what fits the context),
    measured once per machine, dtype and quantization and remembered in ``cache_dir``/step-cost.json."""
    rows = tuple(r for r in BUDGET_ROWS if r <= max_rows and r + 2 <= engine.max_seq_len) or (1,)
    cached = max(1, min(300, engine.max_seq_len - max(rows) - 1))
    key = (f"{machine_key(engine.cfg.model.quantization)} | {str(engine.dtype).removeprefix('torch.')} | "
           f"{engine.device.type} | rows {','.join(map(str, rows))} | cached {cached}")
    path = Path(cache_dir) / COSTS_FILE if cache_dir is not None and engine.device.type == "cpu" else None
    known = _read(path)
    if key in known:
        return {int(k): v for k, v in known[key].items()}
    curve = step_curve(engine, rows, cached=cached, repeats=3)
    log.info("step cost (ms vs rows, %d cached): %s", cached, ", ".join(f"{k}: {v:.1f}" for k, v in curve.items()))
    known[key] = {str(k): round(v, 3) for k, v in curve.items()}
    _remember(path, known, "step cost")
    return curve


STEP_GAP_FACTOR = 2.5  # an automatic step budget keeps a step within this many decode steps (head-of-line blocking)


def curve_cost(curve: dict[int, float]) -> Callable[[float], float]:
    """ms of a step of ``rows`` rows on a measured curve {rows: ms}: linear between its points, extrapolated past its
    ends (a one-point curve: flat below its point, proportional above)."""
    xs = sorted(curve)
    ys = [curve[x] for x in xs]

    def cost(rows: float) -> float:
        if len(xs) == 1:
            return ys[0] * rows / xs[0] if rows > xs[0] else ys[0]
        i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (rows - x0) / (x1 - x0), 1e-6)

    return cost


def step_token_budget(curve: dict[int, float], base_rows: int = 1, factor: float = STEP_GAP_FACTOR,
                      floor: int = 16) -> int:
    """``server.max_step_tokens: null``: the most rows a step may take when ``base_rows`` of them are the decoding
    sequences' rows: as many as keep the step within ``factor`` times what those rows alone cost on the measured
    curve, so a prompt chunk delays the other streams' next tokens by at most that much; at least ``floor`` rows of
    prompt. A flat curve (a GPU) gives the most rows."""
    cost, xs = curve_cost(curve), sorted(curve)
    limit = factor * cost(max(base_rows, xs[0]))
    lo, hi = base_rows, max(xs[-1], base_rows)
    while lo < hi:  # the most rows within the limit (the curve rises with rows)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= limit else (lo, mid - 1)
    return max(lo, base_rows + floor)


def machine_key(quantization: str) -> str:
    """What the fastest CPU dtype depends on: the processor (model name and the features that decide 16-bit speed),
    torch, threads, and the weight quantization."""
    flags = cpu_flags()
    feats = [f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2") if f in flags]
    threads = torch.get_num_threads()
    return f"{cpu_model()} [{' '.join(feats)}] | torch {torch.__version__} | {threads} threads | {quantization}"


def choose_dtype(measure: Callable[[str], dict[int, float]], device: torch.device, quantization: str,
                 cache_dir: Path | None) -> str:
    """The serving dtype for ``model.dtype: auto``: bfloat16 on CUDA; on CPU the candidate with the lowest
    T(1) + T(8) as ``measure(dtype)`` reports it, remembered in ``cache_dir``/serving-dtype.json per machine key."""
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    key = machine_key(quantization)
    path = Path(cache_dir) / CHOICE_FILE if cache_dir is not None else None
    known = _read(path)
    if key in known and known[key].get("dtype") in AUTO_CANDIDATES:
        log.info("model.dtype auto: %s (measured before on this machine: %s)", known[key]["dtype"], key)
        return known[key]["dtype"]
    scores = {}
    for dtype in AUTO_CANDIDATES:
        curve = measure(dtype)
        scores[dtype] = {"ms": {str(k): round(v, 3) for k, v in curve.items()}, "score": sum(curve.values())}
    best = min(scores, key=lambda d: scores[d]["score"])
    log.info("model.dtype auto: %s (T(1) + T(8) in ms: %s; %s)", best,
             ", ".join(f"{d} {s['score']:.1f}" for d, s in scores.items()), key)
    known[key] = {"dtype": best, "measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "candidates": scores}
    _remember(path, known, "dtype choice")
    return best


def tune_linear(weights: list[torch.Tensor], cache_dir: Path | None) -> dict[str, str]:
    """Choose the dense matmul kernel of each weight shape (``core.ops.measure_linear_kernels``), remembered in
    ``cache_dir``/linear-kernels.json per machine key: a later start on the same machine uses the same kernels, and
    so the same bits. Returns {shape key: kernel}."""
    path = Path(cache_dir) / KERNELS_FILE if cache_dir is not None else None
    known = _read(path)
    machine = machine_key("none")
    mine = known.setdefault(machine, {})
    groups: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        groups.setdefault(linear_key(w), []).append(w)
    chosen, measured = {}, False
    for key, same in groups.items():
        name = "x".join(map(str, key))
        if name not in mine:
            best, report = measure_linear_kernels(same)
            mine[name] = {"kernel": best, "candidates": report}
            measured = True
            log.info("linear %s: %s (%s)", name, best, ", ".join(
                f"{k} {r['ms']:.3f} ms{'' if r['row_invariant'] else ' not row-invariant'}" for k, r in report.items()))
        chosen[name] = mine[name]["kernel"]
        use_linear_kernel(key, chosen[name])
    if measured:
        _remember(path, known, "kernel choice")
    return chosen


def choose_int4_form(shape: tuple[int, int], dtype: torch.dtype, cache_dir: Path | None) -> str:
    """The form of PyTorch's path's int4 matrices (``core.ops.measure_int4_forms``: "packed" or "dense") for
    activations in ``dtype``, measured on the target's widest matrix ``shape`` and remembered in
    ``cache_dir``/linear-kernels.json per machine key, as the dense kernels are: a later start multiplies the same
    way, and so gives the same bits."""
    path = Path(cache_dir) / KERNELS_FILE if cache_dir is not None else None
    known = _read(path)
    mine = known.setdefault(machine_key("int4"), {})
    name = "int4 " + "x".join(map(str, shape)) + " " + str(dtype).removeprefix("torch.")
    if name not in mine:
        best, report = measure_int4_forms(shape, dtype)
        mine[name] = {"form": best, "candidates": report}
        log.info("%s: %s (%s)", name, best, ", ".join(f"{k} {ms:.3f} ms" for k, ms in report.items()))
        _remember(path, known, "int4 form")
    return mine[name]["form"]


def _remember(path: Path | None, known: dict, what: str) -> None:
    """Write a measurement file back (``path`` None: no cache directory, nothing to write)."""
    if path is None:
        return
    try:  # written whole under another name, then renamed: a replica starting beside this one never reads half
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only cache (a baked container image): measure again next start
        log.warning("could not remember the %s in %s: %s", what, path, e)


def _read(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
