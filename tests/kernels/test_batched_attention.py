"""tree_attention_batched (one launch over several sequences) vs its reference and vs the single-sequence kernel."""
import random

import pytest
import torch

from specserve_kernels.tree_attention import tree_attention, tree_attention_batched
from specserve_kernels.tree_attention_reference import tree_attention_batched_ref
from specserve_kernels.tree_mask import ancestor_bitmask

H, H_KV = 4, 2  # GQA group of 2
NUM_SLOTS, S = 6, 160


def chain(n):
    return [-1] + list(range(n - 1))


def random_tree(n, seed):
    rng = random.Random(seed)
    return [-1] + [rng.randrange(i) for i in range(1, n)]


# (slot, cache_len, rows): rows is a parents list (a draft tree) or an int (that many causal rows).
# Float32 tiles are BLOCK_N=32 wide, 16-bit ones 64: cache lengths 32, 37 and 70 sit on and across those bounds.
MIXED = [
    (3, 37, [-1]),  # decode step
    (0, 32, chain(5)),
    (5, 70, [-1, 0, 0, 1, 1, 2, 5, 3, 0, 8, 6, 2]),  # branching tree, ancestor bits not a contiguous range
    (1, 9, 20),  # prompt chunk after a cached prefix
    (4, 5, 0),  # a sequence with no rows this step
    (2, 0, 11),  # first prompt chunk
]
BIG_TREE = [(4, 0, random_tree(64, seed=7)), (1, 31, [-1]), (0, 64, 70)]  # bit 63 = int64 sign bit


def make_batch(seqs, D, device, dtype=torch.float32, layers=2):
    """Pool [L, slots, H_kv, S, D] with NaN wherever no sequence may read, q, and the per-sequence tensors."""
    k_pool = torch.full((layers, NUM_SLOTS, H_KV, S, D), float("nan"), dtype=dtype)
    v_pool = torch.full_like(k_pool, float("nan"))
    row_starts, slots, cache_lens, causal, masks = [0], [], [], [], []
    for slot, cache_len, rows in seqs:
        tree = isinstance(rows, list)
        n = len(rows) if tree else rows
        k_pool[:, slot, :, :cache_len + n] = torch.randn(layers, H_KV, cache_len + n, D).to(dtype)
        v_pool[:, slot, :, :cache_len + n] = torch.randn(layers, H_KV, cache_len + n, D).to(dtype)
        row_starts.append(row_starts[-1] + n)
        slots.append(slot)
        cache_lens.append(cache_len)
        causal.append(not tree)
        # Causal rows get all bits set: the kernel must ignore them.
        masks.append(ancestor_bitmask(rows) if tree else torch.full((n,), -1, dtype=torch.int64))
    q = torch.randn(row_starts[-1], H, D).to(dtype)  # [T_total, H, D]

    def on(t):
        return t.to(device)

    return (on(q), on(k_pool), on(v_pool), on(torch.tensor(slots, dtype=torch.int32)), on(torch.tensor(cache_lens)),
            on(torch.tensor(row_starts, dtype=torch.int32)), on(torch.cat(masks)), on(torch.tensor(causal)))


@pytest.mark.parametrize(
    "seqs, D, dtype",
    [(MIXED, 16, torch.float32), (BIG_TREE, 16, torch.float32), (MIXED, 32, torch.float16)],
    ids=["mixed-f32", "tree64-f32", "mixed-f16"],
)
def test_batched_matches_ref(seqs, D, dtype, device):
    q, k_pool, v_pool, slots, cache_lens, row_starts, mask, causal = make_batch(seqs, D, device, dtype)
    args = (q, k_pool[1], v_pool[1], slots, cache_lens, row_starts, mask, causal)
    out = tree_attention_batched(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = tree_attention_batched_ref(*args)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref)
    else:
        # The kernel rounds P to float16 before the P@V dot (the ref keeps it float32) and both
        # round the output to float16: allow a few float16 ulps.
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def _positions(seqs):
    """Each row's position: causal rows cache_len + j, a tree row cache_len + its depth."""
    out = []
    for _, cache_len, rows in seqs:
        if isinstance(rows, list):
            depth = []
            for p in rows:
                depth.append(0 if p < 0 else depth[p] + 1)
            out += [cache_len + d for d in depth]
        else:
            out += range(cache_len, cache_len + rows)
    return torch.tensor(out)


@pytest.mark.parametrize("window", [3, 30])
def test_sliding_window_matches_ref(window, device):
    """A sliding-window layer: every sequence's rows read keys at positions > theirs - window only."""
    q, k_pool, v_pool, slots, cache_lens, row_starts, mask, causal = make_batch(MIXED, 16, device)
    args = (q, k_pool[1], v_pool[1], slots, cache_lens, row_starts, mask, causal)
    pos = _positions(MIXED).to(device)
    out = tree_attention_batched(*args, window=window, positions=pos)
    torch.testing.assert_close(out, tree_attention_batched_ref(*args, window=window, positions=pos))
    assert not torch.allclose(out, tree_attention_batched_ref(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batched_equals_single_sequence_kernel(dtype, device):
    # A sequence's rows must not depend on what else is in the batch. Float32 takes the same tiles in both launchers
    # (same per-row arithmetic, so equal bits); 16-bit tiles are sized per call (per sequence vs the batch average).
    q, k_pool, v_pool, slots, cache_lens, row_starts, mask, causal = make_batch(MIXED, 16, device, dtype)
    out = tree_attention_batched(q, k_pool[0], v_pool[0], slots, cache_lens, row_starts, mask, causal)
    starts = row_starts.tolist()
    for b, (slot, cache_len, rows) in enumerate(MIXED):
        a, e = starts[b], starts[b + 1]
        seq_mask = mask[a:e] if isinstance(rows, list) else None
        single = tree_attention(q[a:e], k_pool[0, slot], v_pool[0, slot], cache_len, seq_mask)
        if dtype == torch.float32:
            assert torch.equal(out[a:e], single), f"sequence {b}"
        else:
            torch.testing.assert_close(out[a:e], single, atol=1e-3, rtol=1e-3)


def test_all_causal_without_mask_strided_q_and_scale(device):
    # tree_mask=None: a prefill-only step. q is sliced out of a fused qkv projection (not contiguous).
    seqs = [(2, 0, 9), (0, 40, 3), (5, 33, 1)]
    _, k_pool, v_pool, slots, cache_lens, row_starts, _, _ = make_batch(seqs, 16, device)
    T = row_starts[-1].item()
    qkv = torch.randn(T, (H + 2 * H_KV) * 16, device=device)
    q = qkv[:, :H * 16].view(T, H, 16)  # [T, H, D], row stride (H + 2 H_kv) D
    assert not q.is_contiguous()
    args = (q, k_pool[1], v_pool[1], slots, cache_lens, row_starts, None, None)
    out = tree_attention_batched(*args, scale=0.3)
    torch.testing.assert_close(out, tree_attention_batched_ref(*args, scale=0.3))


def test_row_that_sees_nothing_is_zero(device):
    # cache_len 0 and a mask without the row's self bit: no visible key at all -> zeros, not NaN.
    q, k_pool, v_pool, slots, cache_lens, row_starts, mask, causal = make_batch([(1, 0, [-1, 0]), (0, 4, 2)], 16,
                                                                               device)
    mask[1] = 0
    out = tree_attention_batched(q, k_pool[0], v_pool[0], slots, cache_lens, row_starts, mask, causal)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all()


def test_empty(device):
    q, k_pool, v_pool, slots, cache_lens, row_starts, mask, causal = make_batch([(0, 3, 0), (1, 0, 0)], 16, device)
    out = tree_attention_batched(q, k_pool[0], v_pool[0], slots, cache_lens, row_starts, mask, causal)
    assert out.shape == (0, H, 16)


def test_validation_errors(device):
    q, k_pool, v_pool, slots, cache_lens, row_starts, mask, causal = make_batch(MIXED, 16, device)
    k, v = k_pool[0], v_pool[0]
    with pytest.raises(ValueError, match="num_slots"):
        tree_attention_batched(q, k[0], v[0], slots, cache_lens, row_starts, mask, causal)
    with pytest.raises(ValueError, match=r"shape \[5\]"):  # B + 1 = 6 offsets for 6 sequences
        tree_attention_batched(q, k, v, slots, cache_lens, row_starts[:-1], mask, causal)
    with pytest.raises(ValueError, match="int64"):
        tree_attention_batched(q, k, v, slots, cache_lens, row_starts, mask.int(), causal)
    with pytest.raises(TypeError):
        tree_attention_batched(q.half(), k, v, slots, cache_lens, row_starts, mask, causal)
    if device != "cpu":
        return
    # Values are checked only on the CPU (no host sync on a device).
    bad = row_starts.clone()
    bad[2] = 0
    with pytest.raises(ValueError, match="rise"):
        tree_attention_batched(q, k, v, slots, cache_lens, bad, mask, causal)
    with pytest.raises(ValueError, match="slots"):
        tree_attention_batched(q, k, v, slots + NUM_SLOTS, cache_lens, row_starts, mask, causal)
    with pytest.raises(ValueError, match="outside a slot"):
        tree_attention_batched(q, k, v, slots, cache_lens + S, row_starts, mask, causal)
    with pytest.raises(ValueError, match="tree_mask is None"):
        tree_attention_batched(q, k, v, slots, cache_lens, row_starts, None, causal)
    q, k_pool, v_pool, slots, cache_lens, row_starts, mask, causal = make_batch([(0, 0, 65)], 16, device)
    with pytest.raises(ValueError, match="at most 64"):
        tree_attention_batched(q, k_pool[0], v_pool[0], slots, cache_lens, row_starts, mask, ~causal)


def test_device_matches_how_the_kernel_was_built(device):
    """Interpreted on CPU, compiled on CUDA: a GPU run tests the compiled batched kernel."""
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    ta = importlib.import_module("specserve_kernels.tree_attention_kernels")
    assert isinstance(ta._tree_attention_batched_kernel, InterpretedFunction) == (device == "cpu")
