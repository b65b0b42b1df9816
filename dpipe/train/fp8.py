"""fp8 base weights for LoRA (`model.base_dtype=fp8`): the blocks' frozen Linear weights stored
as float8_e4m3fn with one scale per output row, upcast to the compute dtype inside forward.

This halves the frozen weights' memory against bf16 (FLUX.1-dev: 22.2 -> ~11.1 GiB), which is what
lets a FLUX.1-dev LoRA fit a 24 GB card. The matmuls still run in bf16 (or fp32): only storage is
8-bit. The upcast weight is a temporary of one Linear at a time; backward upcasts again instead of
keeping it, so no bf16 copy of the weights is ever held for the backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


# The matmul is a custom op with its own backward, opaque to torch.compile: compiled inside a
# block as one autograd.Function, AOTAutograd's partitioner saved the upcast bf16 weights for
# backward (seen with saved-tensor hooks), which would hold a bf16 copy of every weight.
# The op multiplies by the fp8 weight cast to bf16 (exact: a plain cast, reading 1 byte and
# writing 2 per weight); the per-row scale is applied to the output outside the op,
# x @ (s * W8)^T = (x @ W8^T) * s, where a compiled block fuses it into its neighbours. On an
# H200 at FLUX.1-dev size, dequantizing through fp32 inside the op cost 0.12 s per image, and
# scaling the output inside it (an extra pass over the activations) 0.09.
@torch.library.custom_op("dpipe::fp8_matmul", mutates_args=())
def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x @ weight^T in `dtype`, weight in fp8; saves only the fp8 weight for backward."""
    return F.linear(x.to(dtype), weight.to(dtype))


@fp8_matmul.register_fake
def _(x, weight, dtype):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=dtype)


@torch.library.custom_op("dpipe::fp8_matmul_input_grad", mutates_args=())
def fp8_matmul_input_grad(grad: torch.Tensor, weight: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    return grad.to(dtype) @ weight.to(dtype)


@fp8_matmul_input_grad.register_fake
def _(grad, weight, dtype):
    return grad.new_empty((*grad.shape[:-1], weight.shape[1]), dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, weight, dtype = inputs
    ctx.save_for_backward(weight)
    ctx.dtype, ctx.x_dtype = dtype, x.dtype


def _backward(ctx, grad):
    (weight,) = ctx.saved_tensors
    # The weight is frozen: only the input's gradient (for LoRA below) is needed.
    return fp8_matmul_input_grad(grad, weight, ctx.dtype).to(ctx.x_dtype), None, None


fp8_matmul.register_autograd(_backward, setup_context=_setup_context)


class Fp8Linear(nn.Module):
    """A frozen Linear with float8_e4m3fn weights and an fp32 scale per output row.

    `weight` stays a (frozen) Parameter under its Linear name, so checkpoints that leave out frozen
    parameters leave it out, and parameter counts are unchanged; `scale` is derived from it (not
    saved: it is recomputed from the base model's file on every start).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().to(torch.float32)
        # Per-row scaling puts each row's largest weight at fp8's largest value: rows of very
        # different magnitude (common in attention projections) each keep 3 mantissa bits.
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
        self.weight = nn.Parameter((w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8),
                                   requires_grad=False)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().clone(), requires_grad=False))
        # The dtype the Linear ran in before (bf16 base weights, or fp32): used without autocast.
        self.compute_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else self.compute_dtype)
        y = fp8_matmul(x, self.weight, dtype) * self.scale.to(dtype)
        return y if self.bias is None else y + self.bias.to(dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight as the matmul sees it (fp32), for checks and exports of the base."""
        return self.weight.to(torch.float32) * self.scale[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"


def frozen_linears_to_fp8(denoiser: nn.Module) -> int:
    """Replaces the frozen nn.Linear modules of the repeated blocks (every nn.ModuleList) with
    Fp8Linear, peft's LoRA `base_layer`s included; returns how many. Trainable Linears (LoRA's A
    and B) stay as they are. The embedders and the output head outside the blocks stay in the
    compute dtype: they are <1% of the weights, and some families read their weight's dtype to
    cast inputs."""
    in_blocks = set()
    for module in denoiser.modules():
        if isinstance(module, nn.ModuleList):
            in_blocks.update(id(m) for m in module.modules())
    count = 0
    for parent in list(denoiser.modules()):
        if id(parent) not in in_blocks:
            continue
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and not child.weight.requires_grad:
                setattr(parent, name, Fp8Linear(child))
                count += 1
    return count
