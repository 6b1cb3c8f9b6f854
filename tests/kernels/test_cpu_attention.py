"""The CPU targets' row-invariant attention (specserve_kernels/cpu/attention.cpp; the quantized float32 target's with float16
K/V, the bfloat16 target's with bfloat16 K/V and queries): values against softmax attention, and a row's bits set by
its own query and keys alone, so that prompt rows, draft-tree rows and batched decode steps equal the decode step at
their position."""
from __future__ import annotations

import math

import pytest
import torch

from specserve_kernels import cpu
from specserve_kernels.tree_mask import ancestor_bitmask

pytestmark = pytest.mark.skipif(cpu.load() is None, reason=f"CPU kernels unavailable here: {cpu.unavailable_reason()}")
L = torch.long
NS, HKV, S, D, H = 3, 3, 160, 64, 9


@pytest.fixture(params=[torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def pool(request):
    """A layer of the KV pool, float32, float16 or bfloat16 (the quantized CPU target stores K/V in float16, the
    bfloat16 target in bfloat16; the kernel widens each row exactly on load, so the reference reads the same rounded
    values)."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(NS, HKV, S, D, generator=g).to(request.param),
            torch.randn(NS, HKV, S, D, generator=g).to(request.param))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """One query row q [H, D] over the listed cache rows of one slot's k, v [H_kv, S, D], in float64."""
    kk = k[:, rows].double().repeat_interleave(H // HKV, 0)  # [H, n, D]
    vv = v[:, rows].double().repeat_interleave(H // HKV, 0)
    p = ((q.double()[:, None, :] * kk).sum(-1) / math.sqrt(D)).softmax(-1)
    return (p[..., None] * vv).sum(1)


def decode(q, k, v, slot: int, position: int) -> torch.Tensor:
    """The decode step at ``position``: keys 0..position of the slot, in place."""
    one = torch.tensor([slot])
    return cpu.attend(q[None], k, v, one, torch.tensor([position + 1]), torch.zeros(1, dtype=L),
                      torch.zeros(1, dtype=L))[0]


def test_values_are_softmax_attention_over_the_listed_rows(pool):
    k, v = pool
    q = torch.randn(4, H, D)
    bits = torch.tensor([0b1, 0b101, 0b1001, 0])
    out = cpu.attend(q, k, v, torch.tensor([0, 1, 2, 1]), torch.tensor([20, 20, 33, 7]), torch.tensor([50, 50, 60, 0]),
                     bits)
    want = [reference(q[0], k[0], v[0], list(range(20)) + [50]),
            reference(q[1], k[1], v[1], list(range(20)) + [50, 52]),
            reference(q[2], k[2], v[2], list(range(33)) + [60, 63]),
            reference(q[3], k[1], v[1], list(range(7)))]
    for t in range(4):
        assert (out[t].double() - want[t]).abs().max() < 1e-5, t


def test_tree_rows_equal_the_decode_steps_at_their_positions(pool):
    """A draft tree's rows (written after the cached prefix) read the prefix then their ancestors: once the path is
    accepted and compacted into place, the decode step at each position reads the same keys, and gets the same bits."""
    k, v = pool
    c = 90
    parents = [-1, 0, 1, 0, 3, 2, 1]  # branches at the root and at depth 1
    T = len(parents)
    q = torch.randn(T, H, D)
    out = cpu.attend(q, k, v, torch.full((T,), 1), torch.full((T,), c), torch.full((T,), c),
                     ancestor_bitmask(parents))
    for leaf in (5, 4, 6):
        path = [leaf]
        while parents[path[-1]] != -1:
            path.append(parents[path[-1]])
        path.reverse()  # root .. leaf
        kc, vc = k.clone(), v.clone()
        kc[1, :, c:c + len(path)] = k[1, :, [c + r for r in path]]  # compaction: the accepted rows into place
        vc[1, :, c:c + len(path)] = v[1, :, [c + r for r in path]]
        for depth, row in enumerate(path):
            assert torch.equal(out[row], decode(q[row], kc, vc, 1, c + depth)), (leaf, row)


def test_16_bit_queries_are_widened_and_the_output_rounded_once(pool):
    """The bfloat16 target passes its own queries: the kernel computes in float32 from their exact values and
    returns the output in the query's type."""
    k, v = pool
    T, c = 5, 70
    bits = ancestor_bitmask([-1, 0, 1, 0, 3])
    specs = (torch.full((T,), 2), torch.full((T,), c), torch.full((T,), c), bits)
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(T, H, D).to(dtype)
        out = cpu.attend(q, k, v, *specs)
        assert out.dtype == dtype
        assert torch.equal(out, cpu.attend(q.float(), k, v, *specs).to(dtype))


def test_causal_prompt_rows_and_batched_decodes_equal_lone_decode_steps(pool):
    k, v = pool
    T, c = 40, 17
    q = torch.randn(T, H, D)
    prompt = cpu.attend(q, k, v, torch.zeros(T, dtype=L), torch.arange(c + 1, c + T + 1), torch.zeros(T, dtype=L),
                        torch.zeros(T, dtype=L))
    for t in (0, 1, 15, 16, 17, 39):  # around the 16-key chunks of the softmax
        assert torch.equal(prompt[t], decode(q[t], k, v, 0, c + t)), t
    slots, positions = torch.tensor([2, 0, 1]), torch.tensor([5, 150, 64])
    batch = cpu.attend(q[:3], k, v, slots, positions + 1, torch.zeros(3, dtype=L), torch.zeros(3, dtype=L))
    for b in range(3):
        assert torch.equal(batch[b], decode(q[b], k, v, int(slots[b]), int(positions[b]))), b


def test_rope_attend_writes_rotated_keys_and_values_in_the_pools_type_then_attends(pool):
    """What the decoder runs per layer: RoPE on q and k, each row's K/V into its cache row (rounded to the pool's
    type, float16 for the served target), then ``attend`` over the pool as written."""
    from core.ops import Rope, apply_rope
    from types import SimpleNamespace

    k, v = (t.clone() for t in pool)
    T, c = 3, 40
    qkv = torch.randn(T, (H + 2 * HKV) * D)
    positions = torch.arange(c, c + T)
    cos, sin = Rope(SimpleNamespace(head_dim=D, rope_theta=10000.0, rope_scaling=None), S).table(positions,
                                                                                                 torch.float32)
    slot = torch.ones(T, dtype=L)
    out = cpu.load().rope_attend(qkv, cos[:, 0].contiguous(), sin[:, 0].contiguous(), k, v, slot, positions,
                                 positions + 1, torch.zeros(T, dtype=L), torch.zeros(T, dtype=L), H)
    heads = qkv.view(T, H + 2 * HKV, D)
    rotated = apply_rope(heads[:, :H + HKV], cos, sin)
    # the rotation may round once where torch rounds twice (a fused multiply-add): within float32's last bits, so
    # within one step of bfloat16's 8-bit mantissa where that rounding lands near a boundary
    tol = dict(rtol=2 ** -7, atol=0) if k.dtype == torch.bfloat16 else dict(rtol=0, atol=1e-6)
    torch.testing.assert_close(k[1, :, c:c + T], rotated[:, H:].transpose(0, 1).to(k.dtype), **tol)
    assert torch.equal(v[1, :, c:c + T], heads[:, H + HKV:].transpose(0, 1).to(v.dtype))
    assert k.dtype == pool[0].dtype and not k[1, :, c + T:].ne(pool[0][1, :, c + T:]).any()  # nothing else written
    want = cpu.attend(rotated[:, :H].contiguous(), k, v, slot, positions + 1, torch.zeros(T, dtype=L),
                      torch.zeros(T, dtype=L))
    torch.testing.assert_close(out.view(T, H, D), want, rtol=0, atol=1e-6)


def test_rows_reading_outside_the_pool_are_refused(pool):
    k, v = pool
    q = torch.randn(1, H, D)
    one, zero = torch.ones(1, dtype=L), torch.zeros(1, dtype=L)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu.attend(q, k, v, torch.tensor([NS]), one, zero, zero)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu.attend(q, k, v, zero, torch.tensor([S + 1]), zero, zero)
    with pytest.raises(RuntimeError, match="bits past the slot"):
        cpu.attend(q, k, v, zero, one, torch.tensor([S - 1]), torch.tensor([0b10]))
