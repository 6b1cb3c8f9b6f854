"""Benchmark kv_compact (Triton, one launch) vs kv_compact_ref (torch index_select + copy), and the batched launch.

Run: python -m specserve_kernels.bench_kv_compact [--dtype float16|bfloat16|float32]
Pools: SmolLM2-135M (L=30, H_kv=3, D=64) and an 8B-class model (L=32, H_kv=8, D=128),
4 slots of S=4608 rows; n accepted rows drawn from the tree rows after a 4096-row prefix
and compacted down to row 4096. GB/s counts each moved K and V row read once, written once.
Batched: B sequences in {8, 32, 64} (one slot each, S=1152, prefix 1024), n accepted rows each:
kv_compact_batched (one launch) vs kv_compact once per sequence vs kv_compact_batched_ref.
Needs CUDA; without it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import torch

MODELS = [("SmolLM2-135M", 30, 3, 64), ("8B-class", 32, 8, 128)]
ROWS = (1, 4, 8, 32, 64, 256)
SLOTS, S, PREFIX = 4, 4608, 4096
BATCHES, BATCH_ROWS = (8, 32, 64), (1, 4, 16)
BATCH_S, BATCH_PREFIX = 1152, 1024


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kv_compact: no CUDA device, nothing to benchmark (Triton timings need a GPU).")
        return 0

    from triton.testing import do_bench

    from .kv_compact import kv_compact, kv_compact_ref

    dtype = getattr(torch, args.dtype)
    elt = torch.finfo(dtype).bits // 8
    print(f"device: {torch.cuda.get_device_name()}  dtype: {args.dtype}")
    header = f"{'model':<13}{'n':>5} | {'triton us':>10}{'GB/s':>8} | {'ref us':>9}{'GB/s':>8}"
    print(header)
    print("-" * len(header))
    for name, L, H_kv, D in MODELS:
        k = torch.randn(L, SLOTS, H_kv, S, D, device="cuda", dtype=dtype)  # [L, slots, H_kv, S, D]
        v = torch.randn_like(k)
        for n in ROWS:
            gen = torch.Generator().manual_seed(n)
            span = max(2 * n, 64)  # tree rows the accepted ones are picked from
            src = (torch.randperm(span, generator=gen)[:n].sort().values + PREFIX).cuda()  # [n]
            bytes_moved = 2 * 2 * L * H_kv * n * D * elt
            row = f"{name:<13}{n:>5}"
            for fn in (lambda: kv_compact(k, v, 1, src, PREFIX),
                       lambda: kv_compact_ref(k, v, 1, src, PREFIX)):
                us = do_bench(fn) * 1e3
                row += f" | {us:>9.1f}{bytes_moved / us / 1e3:>8.1f}"
            print(row)
        del k, v
    bench_batched(dtype)
    return 0


def bench_batched(dtype: torch.dtype) -> None:
    """One launch for every sequence of a step vs one kv_compact launch per sequence."""
    from triton.testing import do_bench

    from .kv_compact import kv_compact, kv_compact_batched, kv_compact_batched_ref

    elt = torch.finfo(dtype).bits // 8
    print(f"\nbatched: B sequences in their own slots, n accepted rows each after a {BATCH_PREFIX}-row prefix")
    header = f"{'model':<13}{'B':>4}{'n':>4} | {'batched us':>10}{'GB/s':>8} | {'loop us':>9}{'GB/s':>8} | " \
             f"{'ref us':>9}"
    print(header)
    print("-" * len(header))
    for name, L, H_kv, D in MODELS:
        for B in BATCHES:
            k = torch.randn(L, B, H_kv, BATCH_S, D, device="cuda", dtype=dtype)  # [L, slots, H_kv, S, D]
            v = torch.randn_like(k)
            for n in BATCH_ROWS:
                gen = torch.Generator().manual_seed(n)
                src = [(torch.randperm(2 * n + 8, generator=gen)[:n].sort().values + BATCH_PREFIX).cuda()
                       for _ in range(B)]  # B x [n]
                # Built once per step on the host, as the engine would.
                args = (torch.arange(B, device="cuda", dtype=torch.int32), torch.cat(src),
                        torch.full((B,), BATCH_PREFIX, device="cuda", dtype=torch.int32),
                        torch.arange(0, (B + 1) * n, n, device="cuda", dtype=torch.int32))

                def loop():
                    for b in range(B):
                        kv_compact(k, v, b, src[b], BATCH_PREFIX)

                bytes_moved = 2 * 2 * L * H_kv * B * n * D * elt
                us_batched = do_bench(lambda: kv_compact_batched(k, v, *args, max_rows=n)) * 1e3
                us_loop = do_bench(loop) * 1e3
                us_ref = do_bench(lambda: kv_compact_batched_ref(k, v, *args)) * 1e3
                print(f"{name:<13}{B:>4}{n:>4} | {us_batched:>10.1f}{bytes_moved / us_batched / 1e3:>8.1f}"
                      f" | {us_loop:>9.1f}{bytes_moved / us_loop / 1e3:>8.1f} | {us_ref:>9.1f}")


if __name__ == "__main__":
    sys.exit(main())
