"""retained_heap: the block runs as it would without it, errors included."""

from __future__ import annotations

import pytest
import torch
from bdsgd.stages.heap import retained_heap


def test_the_block_runs_and_its_errors_pass_through():
    with retained_heap():
        total = sum(float(torch.ones(1 << 20).sum()) for _ in range(3))
    assert total == 3 * (1 << 20)
    with pytest.raises(ValueError, match="inside"), retained_heap():
        raise ValueError("inside")
    with retained_heap():  # usable again after an error
        assert float(torch.ones(4).sum()) == 4.0
