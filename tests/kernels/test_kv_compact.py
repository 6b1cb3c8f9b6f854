import pytest
import torch

from specserve_kernels import kv_compact, kv_compact_ref

L, SLOTS, H_KV = 3, 4, 2


def make_pool(S, D, device, dtype=torch.float32):
    k = torch.randn(L, SLOTS, H_KV, S, D, device=device).to(dtype)  # [L, slots, H_kv, S, D]
    v = torch.randn(L, SLOTS, H_KV, S, D, device=device).to(dtype)  # [L, slots, H_kv, S, D]
    return k, v


def expected_after(cache, slot, src, dst_start):
    """Independent of both implementations: per-row Python copy from a snapshot."""
    old, new = cache.clone(), cache.clone()
    for i, r in enumerate(src):
        new[:, slot, :, dst_start + i] = old[:, slot, :, r]
    return new


@pytest.mark.parametrize(
    "src, dst_start, S, D, dtype",
    [
        ([5, 7, 8], 5, 32, 64, torch.float32),  # overlap, moving down onto a source row
        ([10, 12, 13], 11, 32, 128, torch.float16),  # overlap, moving up (dst 12, 13 are sources)
        # Up over the next source: an in-order row-by-row copy would read row 11 after
        # writing it. (The interpreter runs programs one after another, so only such an
        # order-dependent hazard is visible on CPU; warp-level races are not.)
        ([10, 11, 13], 11, 32, 32, torch.float32),
        ([20, 21, 25, 30], 2, 32, 24, torch.float32),  # disjoint ranges; D not a power of two
        ([17], 9, 32, 64, torch.bfloat16),  # n = 1
        ([4], 4, 32, 16, torch.float32),  # n = 1, row onto itself
        (list(range(1, 512, 2))[:256], 0, 520, 64, torch.float32),  # n = 256, max tile
    ],
)
def test_kv_compact_matches_ref(src, dst_start, S, D, dtype, device):
    slot = 2
    k, v = make_pool(S, D, device, dtype)
    k_ref, v_ref = k.clone(), v.clone()
    k_exp = expected_after(k, slot, src, dst_start)
    v_exp = expected_after(v, slot, src, dst_start)
    src_rows = torch.tensor(src, dtype=torch.int64, device=device)

    kv_compact(k, v, slot, src_rows, dst_start)
    kv_compact_ref(k_ref, v_ref, slot, src_rows, dst_start)

    # A copy must be bit-exact, so compare with equality rather than a tolerance.
    assert torch.equal(k, k_exp) and torch.equal(v, v_exp)
    assert torch.equal(k_ref, k_exp) and torch.equal(v_ref, v_exp)


def test_every_layer_and_head_moves_other_slots_untouched(device):
    k, v = make_pool(40, 32, device)
    k0, v0 = k.clone(), v.clone()
    src, dst_start, slot = [6, 9, 10, 11, 15], 6, 1
    kv_compact(k, v, slot, torch.tensor(src, device=device), dst_start)
    for cache, before in ((k, k0), (v, v0)):
        for layer in range(L):
            for head in range(H_KV):
                for i, r in enumerate(src):
                    assert torch.equal(cache[layer, slot, head, dst_start + i], before[layer, slot, head, r])
        others = [s for s in range(SLOTS) if s != slot]
        assert torch.equal(cache[:, others], before[:, others])
        # Rows of the slot outside the destination range keep their old values.
        assert torch.equal(cache[:, slot, :, :dst_start], before[:, slot, :, :dst_start])
        assert torch.equal(cache[:, slot, :, dst_start + len(src):], before[:, slot, :, dst_start + len(src):])


def test_empty_src_is_noop(device):
    k, v = make_pool(16, 16, device)
    k0 = k.clone()
    kv_compact(k, v, 0, torch.empty(0, dtype=torch.int64, device=device), 3)
    assert torch.equal(k, k0)


def test_validation_errors(device):
    k, v = make_pool(300, 16, device)
    with pytest.raises(ValueError, match="at most 256"):
        kv_compact(k, v, 0, torch.arange(257, device=device), 0)
    with pytest.raises(ValueError, match="destination"):
        kv_compact(k, v, 0, torch.tensor([1, 2], device=device), 299)
    with pytest.raises(ValueError, match="slot"):
        kv_compact(k, v, SLOTS, torch.tensor([1], device=device), 0)
    with pytest.raises(ValueError, match="int64"):
        kv_compact(k, v, 0, torch.tensor([1], dtype=torch.int32, device=device), 0)
    with pytest.raises(ValueError):
        kv_compact(k, v.half(), 0, torch.tensor([1], device=device), 0)
    if device == "cpu":
        with pytest.raises(ValueError, match="src_rows"):
            kv_compact(k, v, 0, torch.tensor([300]), 0)


def test_device_matches_how_the_kernels_were_built(device):
    """The fixture's device is the one the kernels were decorated for (interpreted on CPU, compiled on CUDA), so a GPU
    run tests compiled kernels on CUDA tensors rather than falling back to CPU."""
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    ta = importlib.import_module("specserve_kernels.tree_attention_kernels")
    kc = importlib.import_module("specserve_kernels.kv_compact")
    for kernel in (ta._tree_attention_kernel, kc._kv_compact_kernel):
        assert isinstance(kernel, InterpretedFunction) == (device == "cpu")
