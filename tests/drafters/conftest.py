"""Fixtures of the Falcon drafter tests (tests/drafters/test_falcon*.py): the tiny target, random Falcon heads for it,
and one torch thread, which those modules ask for with ``pytestmark``."""
from __future__ import annotations

import pytest
import torch

from server.engine import load_target
from tests.drafters.falcon_tiny import _random_checkpoint, _tiny_config


@pytest.fixture
def _one_thread():
    """One thread: OpenMP spin/wake costs dominate the tiny forwards (200x here), and on a busy 2-core machine the
    default model's few-row forwards also ran 2.5x faster on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_target(_tiny_config(tiny_dir), progress=False)


@pytest.fixture(scope="module")
def tiny_ckpt(tiny, tmp_path_factory):
    """{k: checkpoint path} of random heads for the tiny target; "taps": k = 2, reading the stream after layer 1."""
    d = tmp_path_factory.mktemp("falcon-tiny")
    out = {k: str(_random_checkpoint(tiny, d / f"falcon-k{k}.safetensors", k=k)) for k in (2, 3)}
    out["taps"] = str(_random_checkpoint(tiny, d / "falcon-taps.safetensors", k=2, taps=(1,), seed=1))
    return out
