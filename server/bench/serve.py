"""`specserve bench serve`: drive a running server through the OpenAI streaming API at one or more concurrencies.

For each concurrency level in turn (one sweep, one server, an untimed warm-up request of the same length first),
sends `num_requests` chat/text completions from a prompts file with that many in flight, greedy, streaming with
`include_usage`, and reports per level: request throughput, output tokens/s and errors, plus median / p90 / p99 of

- TTFT: request sent -> first chunk that carries text;
- TPOT: time per output token after the first, per request: (E2E - TTFT) / (tokens - 1);
- ITL: inter-token latency, every gap between consecutive text-carrying chunks of every request (what a reader of
  the stream waits between updates; with a speculative drafter one chunk can carry several tokens, which TPOT
  averages out and ITL does not);
- E2E: request sent -> stream closed.

Works against any OpenAI-compatible server; token counts come from the usage chunk (text chunks when it is absent).
The prefix-caching workloads (`--workload multi-turn | shared-prefix`) are `server.bench.prefix`'s.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import re
import statistics
import time
import urllib.request

from server.tokenization import read_prompts


def parse_levels(arg: str) -> list[int]:
    """`--concurrency` as given: one integer or a comma-separated sweep, each a positive integer, run in that order."""
    try:
        levels = [int(x) for x in arg.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency: {arg!r} is not a comma-separated list of integers") from None
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--concurrency: {arg!r}: each level must be a positive integer")
    return levels


def default_num_requests(concurrency: int) -> int:
    """Requests per level when not given: enough that every slot turns over at least twice, and never fewer than 8."""
    return max(2 * concurrency, 8)


def require_matplotlib() -> None:
    """Fail before a sweep that would end in a plot that cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'specserve[plot]' (or pip install matplotlib)") from None


def _pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile by linear interpolation between closest ranks (numpy's default); None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    k = q / 100 * (len(xs) - 1)
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _summary(xs: list[float]) -> dict:
    """median / p90 / p99 / mean and the sample count; None statistics (valid JSON) when there are no samples."""
    return {"median": _pct(xs, 50), "p90": _pct(xs, 90), "p99": _pct(xs, 99),
            "mean": statistics.fmean(xs) if xs else None, "count": len(xs)}


def cached_tokens(usage) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``: prompt tokens the server took from its prefix cache; None when
    the server does not report it (no ``prompt_tokens_details``, or no ``cached_tokens`` in it)."""
    details = getattr(usage, "prompt_tokens_details", None)
    if isinstance(details, dict):
        n = details.get("cached_tokens")
    else:
        n = getattr(details, "cached_tokens", None)
    return None if n is None else int(n)


async def _one(client, model: str, rec: dict, max_tokens: int, extra_body: dict | None = None) -> dict:
    """One streamed request: the arrival time of every chunk that carries text, the usage's token counts (prompt,
    cached: None when the server does not report them) and the text. ``extra_body``: fields the openai client does
    not know (e.g. ``cache_salt``), sent as they are."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    usage = None
    kw = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}}
    if extra_body:
        kw["extra_body"] = extra_body
    if "messages" in rec:
        stream = await client.chat.completions.create(messages=rec["messages"], **kw)
    else:
        stream = await client.completions.create(prompt=rec["prompt"], **kw)
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            c = chunk.choices[0]
            piece = c.delta.content if hasattr(c, "delta") else c.text
            if piece:
                arrivals.append(now)
                pieces.append(piece)
    end = time.perf_counter()
    n = usage.completion_tokens if usage is not None else len(arrivals)
    ttft = (arrivals[0] if arrivals else end) - t0
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {"ttft": ttft, "e2e": end - t0, "tokens": n, "chunks": len(arrivals),
            "tpot": (end - t0 - ttft) / (n - 1) if arrivals and n > 1 else None, "gaps": gaps,
            "prompt_tokens": getattr(usage, "prompt_tokens", None), "cached_tokens": cached_tokens(usage),
            "text": "".join(pieces)}


async def _level(client, model: str, prompts: list[dict], concurrency: int, num_requests: int,
                 max_tokens: int) -> dict:
    """One concurrency level: `num_requests` requests, at most `concurrency` in flight."""
    sem = asyncio.Semaphore(concurrency)
    results, errors = [], []

    async def task(i: int):
        async with sem:
            try:
                results.append(await _one(client, model, prompts[i % len(prompts)], max_tokens))
            except Exception as e:  # counted and reported, the run goes on
                errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(task(i) for i in range(num_requests)))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "num_requests": num_requests, "max_tokens": max_tokens,
            "completed": len(results), "errors": len(errors), "error_samples": list(dict.fromkeys(errors))[:5],
            "wall_s": wall, "requests_per_s": len(results) / wall, "output_tokens_per_s": tokens / wall,
            "output_tokens": tokens, "ttft_s": _summary([r["ttft"] for r in results]),
            "tpot_s": _summary([r["tpot"] for r in results if r["tpot"] is not None]),
            "itl_s": _summary([g for r in results for g in r["gaps"]]),
            "e2e_s": _summary([r["e2e"] for r in results]),
            # per request, without the raw gaps (a long sweep would write one number per token)
            "requests": [{"ttft_s": r["ttft"], "e2e_s": r["e2e"], "tokens": r["tokens"], "chunks": r["chunks"],
                          "tpot_s": r["tpot"], "itl_sum_s": sum(r["gaps"])} for r in results]}


def server_drafter(url: str, api_key: str | None) -> str | None:
    """The drafter a specserve server runs, read from the `drafter` label of its /metrics (None elsewhere)."""
    base = url.rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            m = re.search(r'^specserve_\w+\{[^}]*drafter="([^"]*)"', r.read().decode(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def make_client(url: str, api_key: str | None):
    """An openai AsyncOpenAI client for ``url`` (with or without its /v1), no retries: a failed request counts."""
    from openai import AsyncOpenAI

    base = url.rstrip("/")
    return AsyncOpenAI(base_url=base + ("" if base.endswith("/v1") else "/v1"), api_key=api_key or "none",
                       max_retries=0, timeout=600)


async def connect(client, url: str, prompts: list[dict], max_tokens: int, warmup: int) -> str:
    """The server's (first) model id, after ``warmup`` untimed requests of the prompts; ConnectionError when either
    fails (nothing was measured yet)."""
    try:
        model = (await client.models.list()).data[0].id
        for i in range(warmup):  # first-use costs (connections, lazy setup) stay out of the first level
            await _one(client, model, prompts[i % len(prompts)], max_tokens)
    except Exception as e:
        raise ConnectionError(f"{url}: {type(e).__name__}: {e}") from e
    return model


async def _run(url: str, api_key: str | None, prompts: list[dict], levels: list[int], num_requests: int | None,
               max_tokens: int, warmup: int, log) -> dict:
    client = make_client(url, api_key)
    try:
        model = await connect(client, url, prompts, max_tokens, warmup)
        out = []
        for c in levels:
            n = num_requests if num_requests is not None else default_num_requests(c)
            log(f"concurrency {c}: {n} requests")
            out.append({"url": url, "model": model, **await _level(client, model, prompts, c, n, max_tokens)})
    finally:
        await client.close()
    return {"url": url, "model": model, "workload": "prompts", "max_tokens": max_tokens, "warmup_requests": warmup,
            "concurrency": levels, "errors": sum(lv["errors"] for lv in out), "levels": out}


def run_serve_bench(url: str, api_key: str | None, prompts_path: str, concurrency: list[int] | int,
                    num_requests: int | None, max_tokens: int, warmup: int = 1, log=lambda _: None) -> dict:
    """The sweep report: {"url", "model", "max_tokens", "concurrency", "errors", "levels": [one dict per level]}.

    ``num_requests`` None: `default_num_requests` of each level. Raises ConnectionError when the server cannot be
    listed or warmed up (nothing was measured); per-request errors are counted per level instead."""
    levels = [concurrency] if isinstance(concurrency, int) else list(concurrency)
    return asyncio.run(_run(url, api_key, read_prompts(prompts_path), levels, num_requests, max_tokens, warmup, log))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def format_serve_report(r: dict) -> str:
    """One row per concurrency level (latencies in ms), then a few sample errors of the levels that had any."""
    cols = [("conc", 5), ("done", 11), ("err", 5), ("req/s", 8), ("out tok/s", 10), ("TTFT p50", 9), ("p99", 9),
            ("TPOT p50", 9), ("p99", 9), ("ITL p50", 9), ("p99", 9), ("E2E p50", 9)]
    lines = [f"{r['url']}  model {r['model']}  max_tokens {r['max_tokens']}  latencies in ms",
             " ".join(f"{h:>{w}}" for h, w in cols)]
    for lv in r["levels"]:
        row = [lv["concurrency"], f"{lv['completed']}/{lv['num_requests']}", lv["errors"],
               f"{lv['requests_per_s']:.3f}", f"{lv['output_tokens_per_s']:.2f}",
               _ms(lv["ttft_s"]["median"]), _ms(lv["ttft_s"]["p99"]), _ms(lv["tpot_s"]["median"]),
               _ms(lv["tpot_s"]["p99"]), _ms(lv["itl_s"]["median"]), _ms(lv["itl_s"]["p99"]),
               _ms(lv["e2e_s"]["median"])]
        lines.append(" ".join(f"{v:>{w}}" for v, (_, w) in zip(row, cols)))
    for lv in r["levels"]:
        for e in lv["error_samples"]:
            lines.append(f"error at concurrency {lv['concurrency']}: {e}"[:120])
    return "\n".join(lines)


def plot_serve_report(r: dict, path: str) -> None:
    """Output tok/s, TTFT and TPOT (p50 and p99) against concurrency, side by side, as one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    levels = r["levels"]
    xs = [lv["concurrency"] for lv in levels]

    def ms(key: str, stat: str) -> list[float]:
        return [math.nan if lv[key][stat] is None else 1e3 * lv[key][stat] for lv in levels]

    fig = Figure(figsize=(15, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_tp, ax_ttft, ax_tpot = fig.subplots(1, 3)
    ax_tp.plot(xs, [lv["output_tokens_per_s"] for lv in levels], "o-")
    ax_tp.set(title="throughput", ylabel="output tokens/s")
    for ax, key, name in ((ax_ttft, "ttft_s", "TTFT"), (ax_tpot, "tpot_s", "TPOT")):
        ax.plot(xs, ms(key, "median"), "o-", label="p50")
        ax.plot(xs, ms(key, "p99"), "s--", label="p99")
        ax.set(title=name, ylabel="ms (log scale)", yscale="log")  # one slow outlier would flatten the rest
        ax.legend()
    for ax in (ax_tp, ax_ttft, ax_tpot):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{r['model']}  max_tokens {r['max_tokens']}  {r['url']}")
    fig.savefig(path, dpi=100)
