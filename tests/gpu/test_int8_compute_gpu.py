"""`model.base_compute=int8` on a GPU with int8 matmuls (compute capability 8.0+: Ampere and
later): losses and LoRA gradients against bf16, and the memory its backward keeps, by the checks
`model.base_compute=fp8` passes (tests/gpu/test_fp8_compute_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_fp8_compute_gpu import (assert_base_backward_keeps_no_activation,
                                            assert_lora_gradients_align_with_bf16, train_losses)

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (8, 0),
                                 reason="needs a CUDA GPU with int8 matmuls")]


def test_int8_compute_losses_stay_within_1pct_of_bf16_over_20_steps(tmp_path):
    bf16, _ = train_losses(tmp_path / "bf16")
    int8, log = train_losses(tmp_path / "int8", "model.base_compute=int8")
    assert "frozen Linears multiply in int8" in log, log[-2000:]
    assert len(int8) == len(bf16) == 20
    torch.testing.assert_close(int8, bf16, rtol=1e-2, atol=0)


def test_int8_compute_lora_gradients_align_with_bf16_per_parameter():
    from dpipe.train.int8_compute import use_int8_compute

    assert_lora_gradients_align_with_bf16(use_int8_compute)


def test_int8_compute_keeps_no_activation_for_the_base_backward():
    from dpipe.train.int8_compute import Int8Linear

    assert_base_backward_keeps_no_activation(Int8Linear)
