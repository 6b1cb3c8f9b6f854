"""Run the Triton kernels on CPU through the interpreter.

Triton decides interpreter vs compiler when a kernel is decorated with @triton.jit, i.e.
when `kernels` is first imported, so this must run before any test module imports it.
setdefault lets a GPU run override it with TRITON_INTERPRET=0.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device():
    """cpu under the interpreter; cuda when run with TRITON_INTERPRET=0 on a GPU box."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET is off and there is no CUDA device")
    return "cuda"
