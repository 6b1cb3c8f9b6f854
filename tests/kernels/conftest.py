"""Kernel tests run on the device the kernels were built for.

Triton decides interpreter vs compiler when a kernel is decorated, i.e. when `specserve_kernels` is first imported. The choice
is made once, in tests/conftest.py (loaded before any test module): the interpreter only where there is no CUDA
device, unless TRITON_INTERPRET is set explicitly. This file only reads that choice; it never sets it, since by the
time it loads other test modules may already have imported the kernels.
"""
import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device():
    """cpu under the interpreter; cuda when the kernels are compiled."""
    if INTERPRETED:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 and there is no CUDA device")
    return "cuda"
