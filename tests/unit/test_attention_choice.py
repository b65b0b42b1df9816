"""`model.attention=auto`, the default: cuDNN's kernel for LoRAs on the GPUs where dpipe has
checked it in training (dpipe.pipeline.attention.CUDNN_CHECKED: Hopper), PyTorch's default kernels
for full fine-tunes and elsewhere."""

from __future__ import annotations

import pytest

from dpipe.config.schema import AttentionKernel, ModelConfig, TrainMode
from dpipe.pipeline.attention import kernel_for, require_gpu_kernel, risky_cudnn


def test_auto_is_the_default():
    assert ModelConfig.attention == AttentionKernel.auto


@pytest.mark.parametrize("capability, chosen", [
    ((9, 0), AttentionKernel.cudnn),   # H100, H200: every tiny family checked (tests/gpu)
    ((8, 0), AttentionKernel.sdpa),    # A100
    ((8, 6), AttentionKernel.sdpa),    # RTX 30xx
    ((8, 9), AttentionKernel.sdpa),    # RTX 40xx, L40S
    ((10, 0), AttentionKernel.sdpa),   # B200: not checked
    ((12, 0), AttentionKernel.sdpa),   # RTX 50xx
    (None, AttentionKernel.sdpa),      # no GPU
])
def test_auto_picks_cudnn_on_checked_gpus_only(capability, chosen):
    assert kernel_for(AttentionKernel.auto, capability, TrainMode.lora) == chosen


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), None])
def test_auto_keeps_full_fine_tunes_on_the_default_kernels(capability):
    """Compiled on an H200, the tiny FLUX full fine-tune went NaN with cuDNN's kernel first."""
    assert kernel_for(AttentionKernel.auto, capability, TrainMode.full) == AttentionKernel.sdpa


@pytest.mark.parametrize("kernel", [AttentionKernel.sdpa, AttentionKernel.cudnn,
                                    AttentionKernel.flex])
def test_a_named_kernel_is_kept_on_any_gpu(kernel):
    for mode in TrainMode:
        assert kernel_for(kernel, (9, 0), mode) == kernel_for(kernel, (8, 0), mode) == kernel


def test_auto_trains_on_a_machine_without_cuda():
    require_gpu_kernel(AttentionKernel.auto)  # no ConfigError: auto means sdpa there


def test_only_a_compiled_full_fine_tune_with_cudnn_is_warned():
    """The combination that trained to NaN on an H200 (docs/bench-results/h200-1gpu-auto): eager
    with cuDNN's kernel, or compiled with flash, it trained."""
    assert risky_cudnn(AttentionKernel.cudnn, TrainMode.full, compiles=True)
    assert not risky_cudnn(AttentionKernel.cudnn, TrainMode.full, compiles=False)
    assert not risky_cudnn(AttentionKernel.cudnn, TrainMode.lora, compiles=True)
    assert not risky_cudnn(AttentionKernel.sdpa, TrainMode.full, compiles=True)
