"""The dense matmul kernel choice (core.ops.measure_linear_kernels, server.engine.stepcost.tune_linear).

- a kernel whose rows change bits with the row count is never chosen while a row-invariant one exists;
- the default kernel stays within the noise margin; a clearly faster row-invariant kernel replaces it;
- ``linear`` runs the kernel chosen for the weight's shape and dtype;
- the choice is remembered per machine next to the model, and a later start reuses it without measuring.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from core import ops
from server.engine import stepcost


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(ops, "_chosen", {})


class VirtualClock:
    """core.ops' perf_counter in these tests: only the fake kernels move it, each call by the cost it declares, so a
    kernel's measured time is its calls times its cost, exactly, however loaded the machine is (sleep-timed kernels
    were not: a busy CPU stretched the sleeps and the real matmuls around them)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def costing(self, fn, seconds: float):
        """``fn`` as a kernel that takes ``seconds`` on this clock per call."""
        def kernel(x, w):
            self.now += seconds
            return fn(x, w)
        return kernel


@pytest.fixture
def clock(monkeypatch) -> VirtualClock:
    c = VirtualClock()
    monkeypatch.setattr(ops, "time", SimpleNamespace(perf_counter=c.perf_counter))  # core.ops' clock only
    return c


def _row_count_dependent(x, w):  # fast, exact x @ W.T up to 4 rows, then every row's bits change
    out = F.linear(x, w)
    return out * (1 + 2 ** -6) if x.shape[0] > 4 else out


def _weights(dtype=torch.bfloat16, n=2):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 48, generator=g) * 0.05).to(dtype) for _ in range(n)]


def test_a_kernel_that_is_not_row_invariant_is_never_chosen(monkeypatch, clock):
    monkeypatch.setattr(ops, "LINEAR_KERNELS", {"mv+mm": clock.costing(ops._mv_mm, 1e-3),
                                                "cheat": clock.costing(_row_count_dependent, 1e-4)})
    best, report = ops.measure_linear_kernels(_weights())
    # two weights a pass, a pass at 1 row plus one at 8 rows: 4 calls
    assert report["mv+mm"]["ms"] == pytest.approx(4.0) and report["cheat"]["ms"] == pytest.approx(0.4)
    assert not report["cheat"]["row_invariant"] and report["mv+mm"]["row_invariant"] and best == "mv+mm"


def test_a_clearly_faster_row_invariant_kernel_replaces_the_default(monkeypatch, clock):
    monkeypatch.setattr(ops, "LINEAR_KERNELS", {"mv+mm": clock.costing(ops._mv_mm, 2e-3),
                                                "linear": clock.costing(F.linear, 1e-3)})
    best, report = ops.measure_linear_kernels(_weights())
    assert report["linear"]["ms"] < report["mv+mm"]["ms"] / 1.1
    assert report["linear"]["row_invariant"] and best == "linear"


def test_the_default_stays_within_the_margin(monkeypatch, clock):
    monkeypatch.setattr(ops, "LINEAR_KERNELS", {"mv+mm": clock.costing(ops._mv_mm, 2e-3),
                                                "same": clock.costing(ops._mv_mm, 1.6e-3)})  # 20% less time
    assert ops.measure_linear_kernels(_weights(), margin=0.5)[0] == "mv+mm"
    assert ops.measure_linear_kernels(_weights(), margin=0.1)[0] == "same"  # past the margin it does replace it


def test_without_a_row_invariant_kernel_the_fastest_is_used(monkeypatch, clock):
    monkeypatch.setattr(ops, "LINEAR_KERNELS", {"mv+mm": clock.costing(_row_count_dependent, 2e-3),
                                                "cheat": clock.costing(_row_count_dependent, 1e-3)})
    assert ops.measure_linear_kernels(_weights())[0] == "cheat"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_runs_the_chosen_kernel(monkeypatch, dtype):
    calls = []

    def spy(x, w):
        calls.append(x.shape[0])
        return F.linear(x, w)

    monkeypatch.setitem(ops.LINEAR_KERNELS, "spy", spy)
    w, other = _weights(dtype)[0], torch.zeros(8, 48, dtype=dtype)
    x = torch.randn(3, 48).to(dtype)
    ops.use_linear_kernel(ops.linear_key(w), "spy")
    assert torch.equal(ops.linear(x, w), F.linear(x, w)) and calls == [3]
    ops.linear(x, other)  # another shape: its default kernel
    assert calls == [3]
    with pytest.raises(ValueError, match="unknown linear kernel"):
        ops.use_linear_kernel(ops.linear_key(w), "nope")


def test_tune_linear_remembers_the_choice_per_machine(monkeypatch, tmp_path):
    weights = _weights(torch.bfloat16, 3) + _weights(torch.float32, 1)
    chosen = stepcost.tune_linear(weights, tmp_path)
    assert set(chosen) == {"cpuxbfloat16x64x48", "cpuxfloat32x64x48"}
    saved = json.loads((tmp_path / stepcost.KERNELS_FILE).read_text())
    entry = saved[stepcost.machine_key("none")]["cpuxbfloat16x64x48"]
    assert entry["kernel"] == chosen["cpuxbfloat16x64x48"] and set(entry["candidates"]) == set(ops.LINEAR_KERNELS)

    def no_measuring(_):
        raise AssertionError("measured again")

    monkeypatch.setattr(stepcost, "measure_linear_kernels", no_measuring)
    monkeypatch.setattr(ops, "_chosen", {})
    assert stepcost.tune_linear(weights, tmp_path) == chosen
    assert ops._chosen[ops.linear_key(weights[0])] == chosen["cpuxbfloat16x64x48"]
