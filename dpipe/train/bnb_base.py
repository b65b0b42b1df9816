"""bitsandbytes base weights for LoRA, QLoRA-style (`model.base_dtype=nf4|int8_bnb`): the blocks'
frozen Linears quantized by bitsandbytes' own functions and kept in that form.

- `nf4`: 4-bit NormalFloat codes, two per byte, with an fp32 absmax per block of 64 values
  (`bitsandbytes.functional.quantize_4bit`, as diffusers' `BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type="nf4")` stores a Linear; no double quantization of the absmax): 0.56 bytes
  a value, about a quarter of bf16. Each matmul dequantizes the weight (`dequantize_4bit`) to
  the compute dtype, and backward again instead of keeping it, as `QuantizedLinear` does.
- `int8_bnb`: LLM.int8()'s row-wise int8 (`int8_vectorwise_quant`: each row scaled by its
  absmax / 127), held as the `int8` storage of dpipe.train.fp8 holds it (the same layout: int8
  rows and a scale per row), so it multiplies and swaps as that does. Outlier columns are not
  split off (bitsandbytes' threshold 0, its default): the weight is all int8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpipe.train.fp8 import QuantizedLinear

NF4_BLOCK = 64  # values per absmax: bitsandbytes' and diffusers' default for 4-bit weights


def _nf4_state(shape: torch.Size, absmax: torch.Tensor, code: torch.Tensor, dtype: torch.dtype):
    from bitsandbytes.functional import QuantState

    return QuantState(absmax=absmax, shape=shape, code=code, blocksize=NF4_BLOCK,
                      quant_type="nf4", dtype=dtype)


def nf4_dequantize(packed: torch.Tensor, shape: torch.Size, absmax: torch.Tensor,
                   code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(packed, _nf4_state(shape, absmax, code, dtype))


# A custom op with its own backward, as dpipe.train.fp8's matmul and for its reason: compiled
# inside a block, an autograd.Function had its dequantized weights saved for backward (seen with
# saved-tensor hooks): a bf16 copy of every weight held.
@torch.library.custom_op("dpipe::nf4_matmul", mutates_args=())
def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
               out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """x @ W^T in `dtype`, W dequantized from its NF4 codes; saves only the codes for backward
    (the weight is frozen: only the input's gradient is needed)."""
    weight = nf4_dequantize(packed, torch.Size((out_features, in_features)), absmax, code, dtype)
    return F.linear(x.to(dtype), weight)


@nf4_matmul.register_fake
def _(x, packed, absmax, code, out_features, in_features, dtype):
    return x.new_empty((*x.shape[:-1], out_features), dtype=dtype)


@torch.library.custom_op("dpipe::nf4_matmul_input_grad", mutates_args=())
def nf4_matmul_input_grad(grad: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                          code: torch.Tensor, out_features: int, in_features: int,
                          dtype: torch.dtype) -> torch.Tensor:
    weight = nf4_dequantize(packed, torch.Size((out_features, in_features)), absmax, code, dtype)
    return grad.to(dtype) @ weight


@nf4_matmul_input_grad.register_fake
def _(grad, packed, absmax, code, out_features, in_features, dtype):
    return grad.new_empty((*grad.shape[:-1], in_features), dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, packed, absmax, code, out_features, in_features, dtype = inputs
    ctx.save_for_backward(packed, absmax, code)
    ctx.sizes, ctx.dtype, ctx.x_dtype = (out_features, in_features), dtype, x.dtype


def _backward(ctx, grad):
    packed, absmax, code = ctx.saved_tensors
    x_grad = nf4_matmul_input_grad(grad, packed, absmax, code, *ctx.sizes, ctx.dtype)
    return x_grad.to(ctx.x_dtype), None, None, None, None, None, None


nf4_matmul.register_autograd(_backward, setup_context=_setup_context)


class NF4Linear(nn.Module):
    """A frozen Linear whose weight bitsandbytes stores in NF4. `weight` stays a frozen Parameter
    under the Linear's name (its packed codes, as checkpoints leave frozen weights out); the
    absmax and NF4 code book are buffers, rebuilt from the base on every start."""

    def __init__(self, linear: nn.Linear):
        from bitsandbytes.functional import quantize_4bit

        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype  # the Linear's dtype before: used without autocast
        packed, state = quantize_4bit(linear.weight.detach(), blocksize=NF4_BLOCK,
                                      quant_type="nf4")
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.register_buffer("absmax", state.absmax, persistent=False)
        self.register_buffer("code", state.code, persistent=False)
        self.shape = linear.weight.shape
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().clone(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else self.compute_dtype)
        y = nf4_matmul(x, self.weight, self.absmax, self.code, self.out_features,
                       self.in_features, dtype)
        return y if self.bias is None else y + self.bias.to(dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight as the matmul sees it (fp32)."""
        return nf4_dequantize(self.weight, self.shape, self.absmax, self.code, torch.float32)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4"


def int8_bnb_linear(linear: nn.Linear) -> QuantizedLinear:
    """The Linear as `QuantizedLinear(int8)` with bitsandbytes' LLM.int8() rows and scales."""
    from bitsandbytes.functional import int8_vectorwise_quant

    rows, absmax, _ = int8_vectorwise_quant(linear.weight.detach().to(torch.float16))
    module = QuantizedLinear(linear, torch.int8)
    module.weight.data = rows
    module.scale = absmax.to(torch.float32) / 127
    return module


# model.base_dtype -> what replaces each frozen block Linear.
MAKE = {"nf4": NF4Linear, "int8_bnb": int8_bnb_linear}
