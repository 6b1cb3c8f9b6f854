"""The CPU block-quantized linear kernel (specserve_kernels/cpu): values against its float64 reference, row invariance bit for
bit, the packed layout, and the clean fallback where it cannot build or run.

The kernel needs AVX-512 VNNI; on a CPU without it every test here but the fallback ones skips, saying so (the engine
then serves quantized models on PyTorch's packed kernels, which tests/engine covers).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve_kernels import cpu as qlinear
from specserve_kernels.cpu import BlockQuantWeight, qlinear_reference

ROOT = Path(__file__).resolve().parents[2]
needs_kernel = pytest.mark.skipif(qlinear.load() is None,
                                  reason=f"qlinear kernel unavailable here: {qlinear.unavailable_reason()}")

# the embedded model's matrices (fused QKV, O, fused gate/up, down; the head is below) and odd ones: N not a multiple
# of the 16-column group, a single block, more rows than one register tile
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ODD_SHAPES = [(17, 32), (50, 64), (1, 96), (33, 160)]


def random_weight(N: int, K: int, bits: int, seed: int = 0) -> BlockQuantWeight:
    g = torch.Generator().manual_seed(seed)
    return BlockQuantWeight.quantize(torch.randn(N, K, generator=g) * 0.05, bits)


def activations(T: int, K: int, seed: int = 1) -> torch.Tensor:
    """Rows with an outlier column now and then, as a transformer's hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    x[:, ::37] *= 20
    return x


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", MODEL_SHAPES + ODD_SHAPES)
def test_kernel_equals_its_reference_up_to_float32_sums(bits, shape):
    N, K = shape
    w, x = random_weight(N, K, bits), activations(11, K)
    got = w.matmul(x)
    assert got.shape == (11, N) and got.dtype == torch.float32
    ref = qlinear_reference(x, w)
    # float32 accumulation of per-block products: relative to the sum of |terms|
    q, ad, _ = qlinear.load().quantize_activations(x)
    scale = (q.double().abs() * ad.double().repeat_interleave(32, dim=1)) @ w.dequantize().double().abs().t()
    err = (got.double() - ref).abs()
    assert (err <= 1e-5 * scale + 1e-6).all(), f"max relative error {(err / scale).max().item():.3g}"


@needs_kernel
def test_the_kernel_computes_the_matrix_with_int8_activations_per_block():
    """Against the plain float product: the error is the activations' 8-bit rounding, per block of 32 (a block's
    outlier does not coarsen the other blocks of its row)."""
    N, K = 576, 576
    w, x = random_weight(N, K, 4), activations(4, K)
    exact = x.double() @ w.dequantize().double().t()
    got = w.matmul(x).double()
    blocks = x.view(4, K // 32, 32).abs().amax(-1).double().repeat_interleave(32, dim=1)  # [T, K]
    # each activation is off by at most half a step of its block (max|x| / 127 / 2)
    bound = (blocks / 254) @ w.dequantize().double().abs().t()
    assert ((got - exact).abs() <= bound * 1.001 + 1e-5).all()
    assert not torch.equal(got, exact)  # it is the int8 path, not a float one


@needs_kernel
def test_activation_quantization_is_round_to_nearest_per_block():
    x = activations(3, 96)
    q, ad, as_ = qlinear.load().quantize_activations(x)
    xb = x.view(3, 3, 32)
    d = xb.abs().amax(-1) / 127
    assert torch.equal(ad, d)
    assert torch.equal(q.view(3, 3, 32).float(), torch.round(xb / d[..., None]))  # the kernel multiplies by 1 / d
    assert torch.equal(as_, d * q.view(3, 3, 32).sum(-1).float())
    zero = qlinear.load().quantize_activations(torch.zeros(1, 32))
    assert torch.equal(zero[0], torch.zeros(1, 32, dtype=torch.int8)) and zero[1].item() == 0


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (50, 64)])
def test_each_rows_result_is_bit_for_bit_independent_of_the_other_rows(bits, shape):
    """1..64 rows: what lets a verified draft row stand for the decode step it replaces."""
    N, K = shape
    w, x = random_weight(N, K, bits), activations(64, K)
    single = torch.cat([w.matmul(x[i:i + 1]) for i in range(64)])
    for t in range(1, 65):
        assert torch.equal(w.matmul(x[:t]), single[:t]), f"{t} rows"
    shuffled = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(w.matmul(x[shuffled]), single[shuffled])


@needs_kernel
def test_the_thread_count_does_not_change_the_bits():
    w, x = random_weight(3072, 576, 4), activations(9, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w.matmul(x)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(w.matmul(x), one)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_bfloat16_rows_are_read_as_their_float32_values():
    w, x = random_weight(576, 576, 4), activations(5, 576).bfloat16()
    got = w.matmul(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, w.matmul(x.float()).bfloat16())


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_keeps_the_codes_scales_and_offsets(bits):
    """The interleaved layout unpacks to what went in, and dequantize() is exactly d * q + m (no kernel needed)."""
    g = torch.Generator().manual_seed(0)
    N, K = 50, 96
    q = torch.randint(0, 16 if bits == 4 else 256, (N, K), generator=g).to(torch.uint8)
    d, m = torch.rand(N, K // 32, generator=g), torch.randn(N, K // 32, generator=g)
    w = BlockQuantWeight.from_blocks(q, d, m, bits)
    assert w.codes.shape == (4, 3, 256 if bits == 4 else 512)  # 50 columns in 4 groups of 16
    got_q, got_d, got_m = w.unpack()
    assert torch.equal(got_q, q) and torch.equal(got_d, d) and torch.equal(got_m, m)
    if bits == 4:
        assert torch.equal(w.dequantize(), (q.float().view(N, 3, 32) * d[..., None] + m[..., None]).view(N, K))
    else:  # the order of operations that gives d * w exactly for GGUF Q8_0 (m = -128 d)
        want = (q.float().view(N, 3, 32) - 128) * d[..., None] + (m + 128 * d)[..., None]
        assert torch.equal(w.dequantize(), want.view(N, K))


def test_int8_blocks_are_signed_codes_with_their_scale():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (16, 64), generator=g).to(torch.int8)
    d = torch.rand(16, 2, generator=g)
    w = BlockQuantWeight.from_int8_blocks(codes, d)
    assert torch.equal(w.dequantize(), codes.float() * d.repeat_interleave(32, dim=1))


def test_quantize_rounds_each_block_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(32, 128, generator=g)
    for bits, steps in ((4, 15), (8, 254)):
        w = BlockQuantWeight.quantize(dense, bits)
        blocks = dense.view(32, 4, 32)
        span = (blocks.amax(-1) - blocks.amin(-1)) if bits == 4 else 2 * blocks.abs().amax(-1)
        bound = (span / steps / 2).repeat_interleave(32, dim=1) * 1.0001 + 1e-7
        assert ((w.dequantize() - dense).abs() <= bound).all(), bits


def test_rejected_shapes_and_codes():
    with pytest.raises(ValueError, match="multiple of 32"):
        BlockQuantWeight.quantize(torch.randn(4, 40), 4)
    with pytest.raises(ValueError, match="0..15"):
        BlockQuantWeight.from_blocks(torch.full((16, 32), 16, dtype=torch.uint8), torch.ones(16, 1),
                                     torch.zeros(16, 1), 4)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_turned_off_it_says_why_and_the_engine_serves_on_pytorchs_kernels():
    code = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from specserve_kernels import cpu
print("module:", cpu.load(), "|", cpu.unavailable_reason())
from server.config import config_from_dict
from server.engine import Engine, load_target
from core.ops import Int4Weight
cfg = config_from_dict({"model": {"source": "embedded", "dtype": "float32", "device": "cpu", "quantization": "int4"},
                        "cache": {"num_slots": 1, "max_seq_len": 64}, "drafter": {"name": "none"}})
target = load_target(cfg, progress=False)
assert isinstance(target.model.layers[0].wqkv.weight, Int4Weight)
out = Engine(cfg, target=target).generate([1, 2, 3], max_new_tokens=4)
print("tokens:", len(out.token_ids))
"""
    r = _run(code, SPECSERVE_QLINEAR="0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "module: None | turned off by SPECSERVE_QLINEAR=0" in r.stdout
    assert "PyTorch's packed kernels (the qlinear kernel is unavailable: turned off" in r.stdout
    assert "tokens: 4" in r.stdout


@needs_kernel
def test_without_a_compiler_the_build_fails_cleanly(tmp_path):
    """A machine with no C++ compiler: load() gives None and a reason instead of raising."""
    code = """
from specserve_kernels import cpu
print("module:", cpu.load())
print("reason:", cpu.unavailable_reason())
"""
    r = _run(code, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "module: None" in r.stdout and "reason: the kernel did not build" in r.stdout
