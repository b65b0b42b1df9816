"""`model.attention`'s choice of SDPA kernels by GPU (`dpipe.train.attention.cudnn_first`); the
kernels themselves are checked on an H200 (docs/bench-results/h200-1gpu-profiles/cudnn_check.py)
and trained with in tests/gpu."""

from __future__ import annotations

import pytest

from dpipe.config.schema import AttentionKernel
from dpipe.train.attention import cudnn_first

A100, RTX_4090, H200, B200 = (8, 0), (8, 9), (9, 0), (10, 0)


@pytest.mark.parametrize("gpu, expected", [(A100, False), (RTX_4090, False), (H200, True),
                                           (B200, True)])
def test_sdpa_puts_cudnn_first_from_hopper_on(gpu, expected):
    assert cudnn_first(AttentionKernel.sdpa, gpu) is expected


@pytest.mark.parametrize("gpu", [A100, H200])
def test_flash_never_and_cudnn_always_put_cudnn_first(gpu):
    assert cudnn_first(AttentionKernel.flash, gpu) is False
    assert cudnn_first(AttentionKernel.cudnn, gpu) is True
    assert cudnn_first(AttentionKernel.flex, gpu) is False
