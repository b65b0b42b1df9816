"""Which attention kernel a run's layers execute (`model.attention`).

Two switches make it: PyTorch's scaled_dot_product_attention picks its kernel (flash,
memory-efficient, cuDNN, math) per call from process-wide flags, read when torch.compile traces
a layer, so `use_sdpa_kernels` sets them once per process before any layer runs; and diffusers'
attention dispatcher routes a denoiser's processors to FlexAttention (`use_attention_kernel`).
Processors that call PyTorch's SDPA directly follow the process-wide flags too.

An earlier session saw cuDNN's attention backward fail or give NaN on an H200 (tiny models,
torch 2.11) and switched it off; checked again in the ninth (docs/bench-results/
h200-1gpu-profiles/cudnn_check.py) it matched flash everywhere. `model.attention=flash` is the
way back if it misbehaves on another stack.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from dpipe.config.schema import AttentionKernel, ModelConfig
from dpipe.errors import ConfigError

# cuDNN first, then what SDPA falls back to where cuDNN cannot run a call.
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
               SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
HOPPER = (9, 0)


def cudnn_first(kernel: AttentionKernel, capability: tuple[int, int]) -> bool:
    """Whether SDPA tries cuDNN's kernel first on a GPU of this compute capability. sdpa: on
    Hopper and newer, where it ran forward and backward at 2x flash's speed on an H200 at the
    shapes dpipe's benchmarks train, with flash's error against an fp32 reference and no NaN,
    masked or not, tiny shapes included (docs/performance.md); elsewhere PyTorch's own order,
    flash first (cuDNN's kernel is not measured there). PyTorch itself ranks cuDNN last."""
    return kernel == AttentionKernel.cudnn or (kernel == AttentionKernel.sdpa
                                               and capability >= HOPPER)


def use_sdpa_kernels(kernel: AttentionKernel) -> None:
    """Sets SDPA's kernel order for this process on a GPU (the CPU has its own kernels only);
    call it before any layer runs or is traced."""
    if not torch.cuda.is_available():
        return
    first = cudnn_first(kernel, torch.cuda.get_device_capability())
    # Merely enabled, cuDNN's kernel would still run where flash cannot (under a mask).
    torch.backends.cuda.enable_cudnn_sdp(first)
    if first:
        # The order torch.nn.attention.sdpa_kernel(..., set_priority=True) sets, for the whole
        # process rather than a `with` block.
        torch._C._set_sdp_priority_order([int(b) for b in CUDNN_FIRST])


def use_attention_kernel(denoiser, cfg: ModelConfig) -> None:
    """Routes the denoiser's attention through `model.attention`'s kernel, by diffusers' attention
    dispatcher (`set_attention_backend`), where the kernel is not SDPA's (flex). Processors that
    call PyTorch directly ignore it, so a family none of whose attention goes through the
    dispatcher is refused, not silently slow."""
    if cfg.attention != AttentionKernel.flex:
        return  # diffusers' default: PyTorch's SDPA, whose kernel `use_sdpa_kernels` chose
    processors = {type(m.processor).__name__: hasattr(m.processor, "_attention_backend")
                  for m in denoiser.modules() if getattr(m, "processor", None) is not None}
    if not any(processors.values()):
        raise ConfigError(
            f"model.attention={cfg.attention.value}: the attention of model.family={cfg.family} "
            f"({', '.join(sorted(processors)) or 'no diffusers processor'}) does not go through "
            "diffusers' attention dispatcher, so its kernel cannot be chosen; use "
            "model.attention=sdpa")
    denoiser.set_attention_backend(cfg.attention.value)


def require_gpu_kernel(kernel: AttentionKernel) -> None:
    """flex and cudnn are GPU kernels: refused on a machine without CUDA."""
    if kernel in (AttentionKernel.flex, AttentionKernel.cudnn) and not torch.cuda.is_available():
        why = ("FlexAttention has no backward pass on the CPU" if kernel == AttentionKernel.flex
               else "cuDNN's attention is a CUDA kernel")
        raise ConfigError(f"model.attention={kernel.value} trains on a CUDA GPU only ({why}); "
                          "use model.attention=sdpa here")
