"""fp8 matmuls for the frozen base under LoRA (`model.base_compute=fp8`).

`model.base_dtype=fp8` (dpipe.train.fp8) only stores the frozen block weights in 8 bits and
multiplies in bf16. Here the multiply itself runs in fp8 (`torch._scaled_mm`), which Hopper
(H100, H200) and Ada (RTX 40xx, L40) GPUs execute at about twice their bf16 rate:

- the frozen weight is float8_e4m3fn with one fp32 scale per output row, exactly as
  `base_dtype=fp8` stores it (the same `QuantizedLinear` parameters);
- the activation is quantised on the fly to e4m3, one scale per token row (its largest magnitude
  maps to 448), computed on the GPU with no host sync;
- the product is `_scaled_mm(x8, W8^T, scale_a=row scales, scale_b=weight row scales)` in the
  compute dtype: the scales are applied in the matmul's epilogue;
- backward computes only the input's gradient (the weight is frozen):
  grad @ (s * W8) = (grad * s) @ W8, with (grad * s) quantised per row to `GRAD_FORMAT`. No
  activation is saved for it: only the fp8 weight, which the module holds anyway.

LoRA's own matmuls (peft's A and B beside the base layer) stay in the compute dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.train.fp8 import (FP8, TOP, QuantizedLinear, compute_device, matmul_support,
                             quantize_for_compute)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The format of the gradient in backward's fp8 matmul; None multiplies in the compute dtype.
GRAD_FORMAT: torch.dtype | None = E4M3
# _scaled_mm needs both weight dimensions divisible by 16 (it checks the inner one of the
# activation and both of the weight); a Linear of other shapes keeps bf16 matmuls.
ALIGN = 16


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D tensor in `dtype` (an fp8 format, or int8) with one fp32 scale per row, (rows, 1):
    x ~ q * scale.

    Each row's largest magnitude maps to the format's largest value (int8: 127, rounded to the
    nearest step). An all-zero row gets a tiny scale and zeros (not NaN); values past the range
    saturate instead of becoming inf. A NaN or inf in a row makes its scale NaN or inf, so a
    diverging step still shows as non-finite."""
    top = TOP[dtype]
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / top
    q = (x / scale).clamp(-top, top)
    if dtype == torch.int8:
        q = q.round()  # a plain cast would truncate toward zero
    return q.to(dtype), scale


class _Fp8Matmul(torch.autograd.Function):
    """y = x @ (scale * W8)^T with x quantised per row; backward gives only x's gradient."""

    @staticmethod
    def forward(ctx, x, weight, scale, out_dtype, grad_format):
        rows = x.reshape(-1, x.shape[-1])
        xq, x_scale = quantize_rows(rows, E4M3)
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                             out_dtype=out_dtype)
        ctx.save_for_backward(weight, scale)
        ctx.x_dtype, ctx.grad_format = x.dtype, grad_format
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.grad_format is None:
            x_grad = (rows * scale.to(rows.dtype)) @ weight.to(rows.dtype)
        else:
            gq, g_scale = quantize_rows(rows.float() * scale, ctx.grad_format)
            ones = torch.ones(1, weight.shape[1], dtype=torch.float32, device=weight.device)
            # mat2 must be column-major: W8 (out, in) as the transpose of a contiguous W8^T.
            x_grad = torch._scaled_mm(gq, weight.t().contiguous().t(), scale_a=g_scale,
                                      scale_b=ones, out_dtype=rows.dtype)
        x_grad = x_grad.view(*grad.shape[:-1], weight.shape[1]).to(ctx.x_dtype)
        return x_grad, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               out_dtype: torch.dtype, grad_format: torch.dtype | None = GRAD_FORMAT
               ) -> torch.Tensor:
    """x @ (scale[:, None] * weight)^T in fp8, `weight` float8_e4m3fn (out, in)."""
    return _Fp8Matmul.apply(x, weight, scale, out_dtype, grad_format)


class Fp8Linear(QuantizedLinear):
    """A frozen Linear stored as `base_dtype=fp8` stores it, multiplying in fp8."""

    def __init__(self, linear: nn.Linear,
                 stored: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__(linear, FP8, stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else self.compute_dtype)
        with torch.autocast(device, enabled=False):
            y = fp8_linear(x, self.weight, self.scale, dtype)
        return y if self.bias is None else y + self.bias.to(dtype)


def use_fp8_compute(denoiser: nn.Module) -> int:
    """Makes the frozen Linears of the denoiser's blocks multiply in fp8 where this process's
    device can (its CUDA GPU, else the CPU) and their shapes allow; the others keep fp8 weights
    and multiply in the compute dtype, as model.base_dtype=fp8 does. Logs one line saying which;
    returns how many multiply in fp8."""
    return quantize_for_compute(denoiser, "fp8", FP8, Fp8Linear, ALIGN,
                                matmul_support(compute_device(), "fp8"))
