"""Benchmark tree_attention (Triton) vs tree_attention_ref vs SDPA with a boolean mask.

Run: python -m kernels.bench_tree_attention [--dtype float16|bfloat16|float32]
Shapes: SmolLM2-135M (H=9, H_kv=3, D=64) and an 8B-class model (H=32, H_kv=8, D=128),
tree rows T in {1, 8, 32, 64} (random trees), verified prefix in {128, 1024, 4096}.
GB/s counts the minimum traffic: q and out once, K and V rows [0, prefix + T) once.
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


def random_tree_mask(T: int, seed: int):
    from .tree_attention import ancestor_bitmask

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

    from .tree_attention import tree_attention, tree_attention_ref, tree_mask_to_bool

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
