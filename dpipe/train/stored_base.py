"""A quantized file's stored 8-bit Linears as the frozen base of a LoRA (ComfyUI's scaled fp8 and
int8 files, its comfy_quant float8 and int8 layouts, int8 convrot:
`dpipe.models.common.quantized_files`, `dpipe.models.common.comfy_quant`).

The loader leaves each such Linear's stored form beside its dequantized weight
(`stored_form`); after LoRA wrapping, the blocks' frozen Linears become `QuantizedLinear`s of
exactly those bytes and scales, as `model.base_dtype=fp8|int8` would make of a bf16 base: the
same memory (1 byte a weight and a scale per row), no second rounding of the file's values.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dpipe.models.common.comfy_quant import rotated
from dpipe.train.fp8 import QuantizedLinear, drop_stored_forms, quantize_frozen_linears

log = logging.getLogger(__name__)


class RotatedQuantizedLinear(QuantizedLinear):
    """An int8 convrot Linear: its rows stored in the basis rotated by the Hadamard matrix H, group
    by group of `group` input columns. H is symmetric and orthogonal, so x @ W^T =
    (x H) @ W_rot^T: the input is rotated, then multiplied by the stored weights; autograd takes
    the input's gradient back through the same rotation."""

    def __init__(self, linear: nn.Linear, stored: tuple[torch.Tensor, torch.Tensor], group: int):
        super().__init__(linear, stored=stored)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return super().forward(rotated(rows, self.group).reshape(x.shape))

    def dequantized(self) -> torch.Tensor:
        return rotated(super().dequantized(), self.group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, convrot group {self.group}"


def _stored_linear(linear: nn.Linear) -> nn.Module:
    form = linear.__dict__.get("stored_form")
    if form is None:
        return linear
    stored = (form.values, form.scale)
    return (RotatedQuantizedLinear(linear, stored, form.group) if form.group
            else QuantizedLinear(linear, stored=stored))


def keep_stored_forms(denoiser: nn.Module) -> int:
    """Replaces each frozen block Linear that carries a stored form with its `QuantizedLinear`;
    returns how many. The stored forms of Linears outside the blocks (which stay in the compute
    dtype, as with model.base_dtype) are dropped."""
    quantize_frozen_linears(denoiser, make=_stored_linear)
    kept = sum(isinstance(m, QuantizedLinear) for m in denoiser.modules())
    drop_stored_forms(denoiser)
    if kept:
        log.info("%d frozen Linears kept as the file stores them (8-bit values, a scale per row)",
                 kept)
    return kept
