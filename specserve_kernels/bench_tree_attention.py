"""Benchmark tree_attention (Triton) vs tree_attention_ref vs SDPA with a boolean mask, and the batched launch.

Run: python -m specserve_kernels.bench_tree_attention [--dtype float16|bfloat16|float32]
Shapes: SmolLM2-135M (H=9, H_kv=3, D=64) and an 8B-class model (H=32, H_kv=8, D=128),
tree rows T in {1, 8, 32, 64} (random trees), verified prefix in {128, 1024, 4096}.
Batched: B sequences in {8, 32, 64}, each with a T-row tree (T in {1, 8}) after a 1024-row prefix in its own slot,
plus a mix (B - 1 of those and one 512-row prompt chunk): tree_attention_batched (one launch) vs tree_attention once
per sequence vs tree_attention_batched_ref.
GB/s counts the minimum traffic: q and out once, K and V rows [0, prefix + T) once (per sequence).
Needs CUDA; without it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

MODELS = [("SmolLM2-135M", 9, 3, 64), ("8B-class", 32, 8, 128)]
TREE_ROWS = (1, 8, 32, 64)
PREFIXES = (128, 1024, 4096)
BATCHES = (8, 32, 64)
BATCH_TREE_ROWS = (1, 8)
BATCH_PREFIX, CHUNK = 1024, 512


def random_tree_mask(T: int, seed: int):
    from .tree_mask import ancestor_bitmask

    rng = random.Random(seed)
    return ancestor_bitmask([-1] + [rng.randrange(i) for i in range(1, T)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tree_attention: no CUDA device, nothing to benchmark (Triton timings need a GPU).")
        return 0

    import torch.nn.functional as F
    from triton.testing import do_bench

    from .tree_attention import tree_attention
    from .tree_attention_reference import tree_attention_ref
    from .tree_mask import tree_mask_to_bool

    dtype = getattr(torch, args.dtype)
    elt = torch.finfo(dtype).bits // 8
    print(f"device: {torch.cuda.get_device_name()}  dtype: {args.dtype}")
    header = f"{'model':<13}{'T':>4}{'prefix':>8} | {'triton us':>10}{'GB/s':>8} | " \
             f"{'ref us':>9}{'GB/s':>8} | {'sdpa us':>9}{'GB/s':>8} | {'max err':>9}"
    print(header)
    print("-" * len(header))
    for name, H, H_kv, D in MODELS:
        for T in TREE_ROWS:
            for prefix in PREFIXES:
                torch.manual_seed(0)
                S = prefix + T
                q = torch.randn(T, H, D, device="cuda", dtype=dtype)  # [T, H, D]
                k = torch.randn(H_kv, S, D, device="cuda", dtype=dtype)  # [H_kv, S, D]
                v = torch.randn(H_kv, S, D, device="cuda", dtype=dtype)  # [H_kv, S, D]
                mask = random_tree_mask(T, seed=T).cuda()  # [T] int64
                bool_mask = tree_mask_to_bool(mask, prefix, T)  # [T, S], built once as the engine would
                q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]

                def sdpa():
                    return F.scaled_dot_product_attention(
                        q4, k.unsqueeze(0), v.unsqueeze(0), attn_mask=bool_mask, enable_gqa=True)

                out = tree_attention(q, k, v, prefix, mask)
                err = (out.float() - tree_attention_ref(q, k, v, prefix, mask).float()).abs().max().item()
                bytes_moved = (2 * T * H * D + 2 * H_kv * S * D) * elt
                row = f"{name:<13}{T:>4}{prefix:>8}"
                for fn in (lambda: tree_attention(q, k, v, prefix, mask),
                           lambda: tree_attention_ref(q, k, v, prefix, mask),
                           sdpa):
                    us = do_bench(fn) * 1e3
                    row += f" | {us:>9.1f}{bytes_moved / us / 1e3:>8.1f}"
                print(row + f" | {err:>9.2e}")
    bench_batched(dtype)
    return 0


def bench_batched(dtype: torch.dtype) -> None:
    """One launch over B sequences vs B single-sequence launches (what the engine did per layer before)."""
    from triton.testing import do_bench

    from .tree_attention import tree_attention, tree_attention_batched
    from .tree_attention_reference import tree_attention_batched_ref

    elt = torch.finfo(dtype).bits // 8
    print(f"\nbatched: B sequences, each a T-row tree after {BATCH_PREFIX} cached rows in its own slot; "
          f"'mix' = B - 1 trees + one {CHUNK}-row prompt chunk")
    header = f"{'model':<13}{'B':>4}{'T':>4}{'mix':>5} | {'batched us':>10}{'GB/s':>8} | " \
             f"{'loop us':>9}{'GB/s':>8} | {'ref us':>9} | {'max err':>9}"
    print(header)
    print("-" * len(header))
    for name, H, H_kv, D in MODELS:
        for B in BATCHES:
            for T in BATCH_TREE_ROWS:
                for mix in (False, True):
                    torch.manual_seed(0)
                    rows = [T] * B
                    causal = [False] * B
                    if mix:
                        rows[-1], causal[-1] = CHUNK, True
                    S = BATCH_PREFIX + max(rows)
                    k = torch.randn(B, H_kv, S, D, device="cuda", dtype=dtype)  # [slots, H_kv, S, D]
                    v = torch.randn_like(k)
                    starts = [0]
                    for n in rows:
                        starts.append(starts[-1] + n)
                    q = torch.randn(starts[-1], H, D, device="cuda", dtype=dtype)  # [T_total, H, D]
                    masks = [random_tree_mask(n, seed=b) if not c else torch.zeros(n, dtype=torch.int64)
                             for b, (n, c) in enumerate(zip(rows, causal))]
                    tree_mask = torch.cat(masks).cuda()  # [T_total] int64
                    # Built once per forward on the host, as the engine would, and shared by every layer.
                    args = (q, k, v,
                            torch.arange(B, device="cuda", dtype=torch.int32),
                            torch.full((B,), BATCH_PREFIX, device="cuda", dtype=torch.int32),
                            torch.tensor(starts, device="cuda", dtype=torch.int32),
                            tree_mask, torch.tensor(causal, device="cuda"))

                    def loop():
                        for b in range(B):
                            a, e = starts[b], starts[b + 1]
                            tree_attention(q[a:e], k[b], v[b], BATCH_PREFIX, None if causal[b] else tree_mask[a:e])

                    out = tree_attention_batched(*args)
                    err = (out.float() - tree_attention_batched_ref(*args).float()).abs().max().item()
                    bytes_moved = (2 * starts[-1] * H * D + 2 * H_kv * D * sum(BATCH_PREFIX + n for n in rows)) * elt
                    us_batched = do_bench(lambda: tree_attention_batched(*args)) * 1e3
                    us_loop = do_bench(loop) * 1e3
                    us_ref = do_bench(lambda: tree_attention_batched_ref(*args)) * 1e3
                    print(f"{name:<13}{B:>4}{T:>4}{'yes' if mix else 'no':>5}"
                          f" | {us_batched:>10.1f}{bytes_moved / us_batched / 1e3:>8.1f}"
                          f" | {us_loop:>9.1f}{bytes_moved / us_loop / 1e3:>8.1f}"
                          f" | {us_ref:>9.1f} | {err:>9.2e}")


if __name__ == "__main__":
    sys.exit(main())
