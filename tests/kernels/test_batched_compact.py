"""kv_compact_batched (every sequence of a step in one launch) vs its reference and a per-row Python copy."""
import pytest
import torch

from specserve_kernels.kv_compact import kv_compact_batched, kv_compact_batched_ref

L, SLOTS, H_KV = 2, 5, 2


def make_pool(S, D, device, dtype=torch.float32):
    k = torch.randn(L, SLOTS, H_KV, S, D).to(dtype).to(device)  # [L, slots, H_kv, S, D]
    v = torch.randn(L, SLOTS, H_KV, S, D).to(dtype).to(device)  # [L, slots, H_kv, S, D]
    return k, v


def batch_tensors(moves, device, index_dtype=torch.int64):
    """moves: [(slot, src rows, dst_start)] -> slots, src_rows, dst_starts, row_starts."""
    row_starts = [0]
    for _, src, _ in moves:
        row_starts.append(row_starts[-1] + len(src))
    return (torch.tensor([m[0] for m in moves], dtype=index_dtype, device=device),
            torch.tensor([r for m in moves for r in m[1]], dtype=torch.int64, device=device),
            torch.tensor([m[2] for m in moves], dtype=index_dtype, device=device),
            torch.tensor(row_starts, dtype=index_dtype, device=device))


def expected_after(cache, moves):
    """Independent of both implementations: per-row Python copy from a snapshot."""
    old, new = cache.clone(), cache.clone()
    for slot, src, dst_start in moves:
        for i, r in enumerate(src):
            new[:, slot, :, dst_start + i] = old[:, slot, :, r]
    return new


STEP = [
    (3, [5, 7, 8], 5),  # overlap, moving down onto a source row
    (0, [10, 11, 13], 11),  # up over the next source: an in-order row-by-row copy would read row 11 after writing it
    (4, [20, 21, 25, 30], 2),  # disjoint ranges
    (1, [], 7),  # nothing accepted beyond the root this step
    (2, [4], 4),  # one row onto itself
]


@pytest.mark.parametrize(
    "moves, S, D, dtype, index_dtype",
    [
        (STEP, 32, 16, torch.float32, torch.int64),
        (STEP, 32, 24, torch.float16, torch.int32),  # D not a power of two
        ([(2, [17], 9)], 32, 32, torch.bfloat16, torch.int32),  # B = 1, n = 1
        # One sequence at the 256-row cap next to a short one: the tile is sized for the longest.
        ([(0, list(range(1, 512, 2))[:256], 0), (3, [300, 302], 299)], 520, 16, torch.float32, torch.int64),
    ],
    ids=["step-f32", "step-f16-int32", "single-bf16", "cap256"],
)
def test_batched_matches_ref_and_loop(moves, S, D, dtype, index_dtype, device):
    k, v = make_pool(S, D, device, dtype)
    k_ref, v_ref = k.clone(), v.clone()
    k_exp, v_exp = expected_after(k, moves), expected_after(v, moves)
    args = batch_tensors(moves, device, index_dtype)

    kv_compact_batched(k, v, *args)
    kv_compact_batched_ref(k_ref, v_ref, *args)

    # A copy must be bit-exact, so compare with equality rather than a tolerance. The expected pools also show that
    # other slots, other rows of each slot and other layers/heads keep their values.
    assert torch.equal(k, k_exp) and torch.equal(v, v_exp)
    assert torch.equal(k_ref, k_exp) and torch.equal(v_ref, v_exp)


def test_untouched_rows_and_slots(device):
    k, v = make_pool(40, 16, device)
    k0, v0 = k.clone(), v.clone()
    moves = [(1, [6, 9, 10, 11, 15], 6), (3, [30, 33], 28)]
    kv_compact_batched(k, v, *batch_tensors(moves, device), max_rows=8)
    for cache, before in ((k, k0), (v, v0)):
        for slot, src, dst in moves:
            for i, r in enumerate(src):
                assert torch.equal(cache[:, slot, :, dst + i], before[:, slot, :, r])
            assert torch.equal(cache[:, slot, :, :dst], before[:, slot, :, :dst])
            assert torch.equal(cache[:, slot, :, dst + len(src):], before[:, slot, :, dst + len(src):])
        others = [s for s in range(SLOTS) if s not in (1, 3)]
        assert torch.equal(cache[:, others], before[:, others])


def test_empty_step_is_noop(device):
    k, v = make_pool(16, 16, device)
    k0 = k.clone()
    kv_compact_batched(k, v, *batch_tensors([(0, [], 3), (1, [], 0)], device))
    kv_compact_batched(k, v, *batch_tensors([], device))
    assert torch.equal(k, k0)


def test_validation_errors(device):
    k, v = make_pool(32, 16, device)
    slots, src, dsts, starts = batch_tensors(STEP, device)
    with pytest.raises(ValueError, match="int64"):
        kv_compact_batched(k, v, slots, src.int(), dsts, starts)
    with pytest.raises(ValueError, match="dst_starts"):
        kv_compact_batched(k, v, slots, src, dsts[:-1], starts)
    with pytest.raises(ValueError, match="max_rows"):
        kv_compact_batched(k, v, slots, src, dsts, starts, max_rows=257)
    if device != "cpu":
        return
    # Values are checked only on the CPU (no host sync on a device).
    with pytest.raises(ValueError, match="distinct"):
        kv_compact_batched(k, v, torch.tensor([0, 0, 1, 2, 3]), src, dsts, starts)
    with pytest.raises(ValueError, match="destination"):
        kv_compact_batched(k, v, slots, src, dsts + 30, starts)
    with pytest.raises(ValueError, match="rise"):
        kv_compact_batched(k, v, slots, src, dsts, starts.flip(0))
    with pytest.raises(ValueError, match="at most 3"):
        kv_compact_batched(k, v, slots, src, dsts, starts, max_rows=3)
    with pytest.raises(ValueError, match="src_rows"):
        kv_compact_batched(k, v, slots, src + 32, dsts, starts)


def test_device_matches_how_the_kernel_was_built(device):
    """Interpreted on CPU, compiled on CUDA: a GPU run tests the compiled batched kernel."""
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    kc = importlib.import_module("specserve_kernels.kv_compact")  # the package re-exports a function of that name
    assert isinstance(kc._kv_compact_batched_kernel, InterpretedFunction) == (device == "cpu")
