"""The learned drafters' ``weights`` option on a dense CPU target (the float32 default model): int8 blocks run by the
CPU kernel, the dense matrices as trained, or (``auto``) whichever one pass over the matrices measured faster."""
from __future__ import annotations

import pytest
import torch

import drafters.checkpoint as ckpt
from drafters.base import create_drafter

LEARNED = ["falcon", "glide"]


@pytest.fixture(scope="module")
def kernel():
    from specserve_kernels import cpu

    if cpu.load() is None:
        pytest.skip(f"no CPU kernel here: {cpu.unavailable_reason()}")
    return cpu


def _dense_2d(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dim() == 2]


@pytest.mark.parametrize("name", LEARNED)
def test_int8_weights_run_the_kernel_and_predict_as_the_dense_model(target32, kernel, name):
    int8 = create_drafter(name, target32, {"weights": "int8"}).model
    dense = create_drafter(name, target32, {"weights": "dense"}).model
    assert isinstance(int8.head_weight, kernel.BlockQuantWeight) and not _dense_2d(int8)
    assert isinstance(dense.head_weight, torch.Tensor) and len(_dense_2d(dense)) >= 5
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(64, target32.args.hidden_size, generator=g)
    want, got = dense.logits(feats), int8.logits(feats)
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9
    assert (want - got).abs().max() <= 0.05 * want.abs().max()


def test_auto_weights_follow_the_measurement(target32, kernel, monkeypatch):
    measured = create_drafter("falcon", target32, {"weights": "dense"}).model
    ms = ckpt.measure_weights(measured)  # the real measurement: both forms timed on this machine
    assert set(ms) == {"dense", "int8"} and min(ms.values()) > 0
    for faster, want in (("int8", kernel.BlockQuantWeight), ("dense", torch.Tensor)):
        monkeypatch.setattr(ckpt, "measure_weights", lambda model, faster=faster: {
            "dense": 1.0 if faster == "int8" else 0.5, "int8": 0.5 if faster == "int8" else 1.0})
        model = create_drafter("falcon", target32).model  # weights: auto
        assert isinstance(model.head_weight, want), faster


@pytest.mark.parametrize("name", ["falcon", "falcon-adaptive", "glide", "glide-cape", "glide-adaptive", "cascade"])
def test_bad_weights_fail_with_the_option(target32, name):
    with pytest.raises(ValueError, match="weights"):
        create_drafter(name, target32, {"weights": "int4"})
