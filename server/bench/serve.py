"""`specserve bench serve`: drive a running server through the OpenAI streaming API.

Sends `--num-requests` chat/text completions from a prompts file with `--concurrency` in flight, greedy, streaming
with `include_usage`, and reports request throughput, output tokens/s, time to first token, inter-token latency
(per request: time after the first token / tokens after the first) and end-to-end latency as median / p90 / p99,
plus errors. Works against any OpenAI-compatible server.
"""
from __future__ import annotations

import asyncio
import statistics
import time

from server.bench.offline import read_prompts


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def _summary(xs: list[float]) -> dict:
    return {"median": _pct(xs, 50), "p90": _pct(xs, 90), "p99": _pct(xs, 99),
            "mean": statistics.fmean(xs) if xs else float("nan")}


async def _one(client, model: str, rec: dict, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    usage = None
    if "messages" in rec:
        stream = await client.chat.completions.create(model=model, messages=rec["messages"], max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
    else:
        stream = await client.completions.create(model=model, prompt=rec["prompt"], max_tokens=max_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            c = chunk.choices[0]
            text = c.delta.content if hasattr(c, "delta") else c.text
            if text and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    n = usage.completion_tokens if usage else 0
    return {"ttft": (first or end) - t0, "e2e": end - t0, "tokens": n,
            "itl": (end - first) / (n - 1) if first is not None and n > 1 else None}


async def _run(url: str, api_key: str | None, prompts: list[dict], concurrency: int, num_requests: int,
               max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1"),
                         api_key=api_key or "none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
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
    await client.close()
    tokens = sum(r["tokens"] for r in results)
    return {"url": url, "model": model, "concurrency": concurrency, "num_requests": num_requests,
            "max_tokens": max_tokens, "completed": len(results), "errors": len(errors), "error_samples": errors[:5],
            "wall_s": wall, "requests_per_s": len(results) / wall, "output_tokens_per_s": tokens / wall,
            "output_tokens": tokens, "ttft_s": _summary([r["ttft"] for r in results]),
            "itl_s": _summary([r["itl"] for r in results if r["itl"] is not None]),
            "e2e_s": _summary([r["e2e"] for r in results])}


def run_serve_bench(url: str, api_key: str | None, prompts_path: str, concurrency: int, num_requests: int,
                    max_tokens: int) -> dict:
    return asyncio.run(_run(url, api_key, read_prompts(prompts_path), concurrency, num_requests, max_tokens))


def format_serve_report(r: dict) -> str:
    def ms(s: dict) -> str:
        return f"median {1e3 * s['median']:.1f}  p90 {1e3 * s['p90']:.1f}  p99 {1e3 * s['p99']:.1f} ms"

    return "\n".join([
        f"{r['url']}  model {r['model']}  concurrency {r['concurrency']}  requests {r['num_requests']}  "
        f"max_tokens {r['max_tokens']}",
        f"completed {r['completed']}  errors {r['errors']}  wall {r['wall_s']:.2f} s",
        f"throughput {r['requests_per_s']:.3f} req/s  output {r['output_tokens_per_s']:.2f} tok/s",
        f"TTFT  {ms(r['ttft_s'])}", f"ITL   {ms(r['itl_s'])}", f"E2E   {ms(r['e2e_s'])}",
    ])
