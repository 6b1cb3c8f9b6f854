"""core.ops.top1, the greedy token of each row: argmax's indices, ties and NaN included, in every dtype served."""
from __future__ import annotations

import pytest
import torch

from core.ops import top1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_top1_is_argmax_with_ties_and_nan(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    for x in (torch.randn(rows, 4099, generator=g),
              torch.randint(-3, 4, (rows, 4099), generator=g).float()):  # many tied maxima per row
        x = x.to(dtype)
        assert torch.equal(top1(x), x.argmax(-1))
        assert torch.equal(top1(x[0]), x[0].argmax(-1))  # one row, no row dimension
    x = torch.randn(rows, 4099, generator=g).to(dtype)
    x[:, 17] = float("nan")
    x[0, 5] = float("nan")
    assert torch.equal(top1(x), x.argmax(-1))
