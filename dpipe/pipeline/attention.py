"""Which attention kernel a run's layers execute (`model.attention`).

Two switches make it: PyTorch's scaled_dot_product_attention picks its kernel (flash,
memory-efficient, cuDNN, math) per call from process-wide flags, read when torch.compile traces
a layer, so `use_sdpa_kernels` sets them once per process before any layer runs; and diffusers'
attention dispatcher routes a denoiser's processors to FlexAttention (`use_attention_kernel`).
Processors that call PyTorch's SDPA directly follow the process-wide flags too.

cuDNN's kernel (`model.attention=cudnn`; `auto`, the default, for LoRAs on the GPUs of
CUDNN_CHECKED) runs at 2x flash's speed on an H200 at real sizes, with flash's error against an fp32 reference
(docs/bench-results/h200-1gpu-profiles/cudnn_check.py). Its backward reads out of bounds when
the gradient it receives is not laid out as its output is (torch 2.11, cuDNN 9.19:
compute-sanitizer names cudnn::fusion::compute_dot_do_o, and eager training goes NaN at its
first step; docs/bench-results/h200-1gpu-cudnn-nan). FLUX's
single blocks hand it such a gradient: the slice of a concatenation. So, with cuDNN chosen,
eager SDPA calls get their output's gradient copied into the output's layout first
(`_gradient_like_output`); compiled layers need not, inductor lays SDPA's backward inputs out
densely itself.

torch.compile's caches do not key on the kernel flags, so each choice has its own cache folder
(`use_compile_cache_of`): switching `model.attention` never reuses a layer compiled for the other.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch.nn.attention import SDPBackend

from dpipe.config.schema import AttentionKernel, ModelConfig, TrainMode
from dpipe.errors import ConfigError

# cuDNN first, then what SDPA falls back to where cuDNN cannot run a call.
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
               SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# The GPUs (compute capabilities) on which cuDNN's kernel has trained every tiny family's LoRA
# to the losses of PyTorch's default kernels and sped real sizes up (docs/performance.md):
# Hopper. Only LoRAs: the tiny FLUX full fine-tune's first gradients are NaN compiled with
# cuDNN's kernel first, where it trains to the default kernels' losses eager with cuDNN's and
# compiled with flash (H200, 2026-12-03, docs/bench-results/h200-1gpu-auto, call 4). So it is
# the two together; why is not known. `auto` keeps full fine-tunes on the default kernels.
CUDNN_CHECKED = {(9, 0)}

log = logging.getLogger("dpipe")


def kernel_for(kernel: AttentionKernel, capability: tuple[int, int] | None,
               mode: TrainMode) -> AttentionKernel:
    """The kernel `model.attention` means for a run of this mode on a GPU of this compute
    capability (None: no GPU): auto is cudnn for a LoRA where CUDNN_CHECKED has the GPU, else
    sdpa; any other choice is itself."""
    if kernel != AttentionKernel.auto:
        return kernel
    checked = capability in CUDNN_CHECKED and mode == TrainMode.lora
    return AttentionKernel.cudnn if checked else AttentionKernel.sdpa


def risky_cudnn(chosen: AttentionKernel, mode: TrainMode, compiles: bool) -> bool:
    """Whether a run is one that has trained to NaN on an H200: a compiled full fine-tune with
    cuDNN's kernel first (CUDNN_CHECKED). Eager, or with flash, it trained."""
    return chosen == AttentionKernel.cudnn and mode == TrainMode.full and compiles


def use_sdpa_kernels(model: ModelConfig, compiles: bool) -> None:
    """Sets SDPA's kernels for this process on a GPU (the CPU has its own kernels only); call it
    before any layer runs or is traced; `compiles`: whether the run's layers compile
    (`PipelineConfig.compiles`). cudnn (or auto on a CUDNN_CHECKED GPU): cuDNN's kernel first
    (`kernel_for`). Otherwise it is off: merely enabled, SDPA would still pick it where flash
    cannot run (under a mask).

    torch.compile's FX-graph and AOTAutograd caches do not key on these flags (measured on an
    H200, docs/bench-results/h200-1gpu-profiles/sdpa_cache.py): a layer compiled under one
    choice runs that kernel in a later process that chose the other, until the cache is cleared
    (TORCHINDUCTOR_CACHE_DIR) or off (TORCHINDUCTOR_FX_GRAPH_CACHE=0
    TORCHINDUCTOR_AUTOGRAD_CACHE=0). So each choice compiles into its own cache folder."""
    if not torch.cuda.is_available():
        return
    capability = torch.cuda.get_device_capability()
    chosen = kernel_for(model.attention, capability, model.mode)
    if model.attention == AttentionKernel.auto:
        log.info("model.attention=auto: %s for a model.mode=%s run on this GPU (%s, compute "
                 "capability %d.%d)", chosen.value, model.mode.value,
                 torch.cuda.get_device_name(), *capability)
    elif risky_cudnn(chosen, model.mode, compiles):
        log.warning("model.attention=cudnn with model.mode=full, compiled: a full fine-tune's "
                    "gradients have been NaN from its first step so on an H200, where eager "
                    "(pipeline.compile=false) it trained (docs/performance.md); "
                    "model.attention=auto or sdpa keeps PyTorch's default kernels")
    cudnn = chosen == AttentionKernel.cudnn
    use_compile_cache_of(cudnn)
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    if cudnn:
        # The order torch.nn.attention.sdpa_kernel(..., set_priority=True) sets, for the whole
        # process rather than a `with` block.
        torch._C._set_sdp_priority_order([int(b) for b in CUDNN_FIRST])
        _lay_out_gradients_for_cudnn()


# The inductor cache folder of each kernel choice, under the user's (or inductor's default).
COMPILE_CACHES = {True: "sdpa-cudnn-first", False: "sdpa-default"}


def use_compile_cache_of(cudnn: bool) -> None:
    """Points torch.compile's cache (TORCHINDUCTOR_CACHE_DIR) at this kernel choice's folder under
    the folder set, or inductor's default. A folder set by an earlier call (in this process, or
    inherited by a worker) counts as its parent: one choice's folder never nests in the other's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    if os.path.basename(base) in COMPILE_CACHES.values():
        base = os.path.dirname(base)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, COMPILE_CACHES[cudnn])


def _lay_out_gradients_for_cudnn() -> None:
    """Wraps torch's scaled_dot_product_attention, process-wide and once: diffusers' processors
    call it by that name, whether through diffusers' dispatcher or directly."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if getattr(sdpa, "dense_gradient", False):
        return

    @functools.wraps(sdpa)
    def sdpa_with_dense_gradient(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        if out.requires_grad and not torch.compiler.is_compiling():
            layout = out.stride()
            out.register_hook(lambda grad: _gradient_like_output(grad, layout))
        return out

    sdpa_with_dense_gradient.dense_gradient = True
    torch.nn.functional.scaled_dot_product_attention = sdpa_with_dense_gradient


def _gradient_like_output(grad: torch.Tensor, layout: tuple[int, ...]) -> torch.Tensor:
    """`grad` itself where it has the output's strides, else a copy with them."""
    if grad.stride() == layout:
        return grad
    return torch.empty_strided(grad.shape, layout, dtype=grad.dtype,
                               device=grad.device).copy_(grad)


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
