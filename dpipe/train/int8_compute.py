"""int8 matmuls for the frozen base under LoRA (`model.base_compute=int8`).

fp8 matmuls (dpipe.train.fp8_compute) need compute capability 8.9 (Ada, Hopper); Ampere GPUs
(A100, RTX 30xx) have int8 tensor cores instead, at twice their bf16 rate. Here the frozen base
multiplies W8A8 in int8 (`torch._int_mm`, int32 accumulation):

- the frozen weight is int8 with one fp32 scale per output row, exactly as `base_dtype=int8`
  stores it (the same `QuantizedLinear` parameters);
- the activation is quantised on the fly to int8, one scale per token row (its largest
  magnitude maps to 127), on the GPU with no host sync;
- the int32 product is rescaled in fp32 by the row scales of both, then cast to the compute dtype;
- backward computes only the input's gradient (the weight is frozen):
  grad @ (s * W8) = (grad * s) @ W8, with (grad * s) quantised per row to int8 when `INT8_GRAD`
  (else multiplied in the compute dtype). No activation is saved for it: only the int8 weight,
  which the module holds anyway.

`_int_mm` on CUDA needs more than 16 rows and both inner dimensions divisible by 8. A Linear whose
dimensions do not divide by 8 keeps the bf16 matmul for good (counted in the start's log line);
a call with 16 token rows or fewer (the modulation Linears, fed one row per sample) multiplies
in bf16 from the same int8 weights, as `base_dtype=int8` does. The rules are the same on every
device, so a CPU run does the GPU's math.

LoRA's own matmuls (peft's A and B beside the base layer) stay in the compute dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.train.fp8 import (QuantizedLinear, compute_device, matmul_support,
                             quantize_for_compute)
from dpipe.train.fp8_compute import quantize_rows

INT8 = torch.int8
# Backward's (grad * s) @ W8 in int8; False multiplies it in the compute dtype. On the CPU the
# tiny FLUX.1 model's 80 LoRA gradients keep a cosine of at least 0.99956 to bf16's with it,
# 0.99963 without (docs/performance.md, 2026-12-07): the int8 gradient costs no accuracy there.
INT8_GRAD = True
# cuBLAS's int8 matmul needs the inner and output dimensions divisible by 8 and more than 16 rows.
ALIGN = 8
MIN_ROWS = 17


class _Int8Matmul(torch.autograd.Function):
    """y = x @ (scale * W8)^T with x quantised per row; backward gives only x's gradient."""

    @staticmethod
    def forward(ctx, x, weight, scale, out_dtype, int8_grad):
        rows = x.reshape(-1, x.shape[-1])
        xq, x_scale = quantize_rows(rows, INT8)
        # weight.t() is column-major: the layout cuBLAS's int8 kernels take for their second input.
        y = torch._int_mm(xq, weight.t()).float() * x_scale * scale.view(1, -1)
        ctx.save_for_backward(weight, scale)
        ctx.x_dtype, ctx.int8_grad = x.dtype, int8_grad
        return y.to(out_dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.int8_grad:
            gq, g_scale = quantize_rows(rows.float() * scale, INT8)
            # The second input column-major again: W8 (out, in) as the transpose of W8^T.
            x_grad = (torch._int_mm(gq, weight.t().contiguous().t()).float() * g_scale
                      ).to(rows.dtype)
        else:
            x_grad = (rows * scale.to(rows.dtype)) @ weight.to(rows.dtype)
        x_grad = x_grad.view(*grad.shape[:-1], weight.shape[1]).to(ctx.x_dtype)
        return x_grad, None, None, None, None


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype, int8_grad: bool = INT8_GRAD) -> torch.Tensor:
    """x @ (scale[:, None] * weight)^T in int8, `weight` int8 (out, in), x of >= MIN_ROWS rows."""
    return _Int8Matmul.apply(x, weight, scale, out_dtype, int8_grad)


class Int8Linear(QuantizedLinear):
    """A frozen Linear stored as `base_dtype=int8` stores it, multiplying in int8."""

    def __init__(self, linear: nn.Linear,
                 stored: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__(linear, INT8, stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < MIN_ROWS * x.shape[-1]:
            return super().forward(x)  # too few rows for the int8 kernel: bf16, as base_dtype=int8
        device = x.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else self.compute_dtype)
        with torch.autocast(device, enabled=False):
            y = int8_linear(x, self.weight, self.scale, dtype)
        return y if self.bias is None else y + self.bias.to(dtype)


def use_int8_compute(denoiser: nn.Module) -> int:
    """Makes the frozen Linears of the denoiser's blocks multiply in int8 where this process's
    device can (its CUDA GPU, else the CPU) and their shapes allow; the others keep int8 weights
    and multiply in the compute dtype, as model.base_dtype=int8 does. Logs one line saying which;
    returns how many multiply in int8."""
    return quantize_for_compute(denoiser, "int8", INT8, Int8Linear, ALIGN,
                                matmul_support(compute_device(), "int8"))
