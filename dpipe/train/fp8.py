"""8-bit base weights for LoRA (`model.base_dtype=fp8|fp8_e5m2|int8`): the blocks' frozen Linear
weights stored as float8_e4m3fn, float8_e5m2 or int8 with one scale per output row, upcast to the
compute dtype inside forward.

This halves the frozen weights' memory against bf16 (FLUX.1-dev: 22.2 -> ~11.1 GiB), which is what
lets a FLUX.1-dev LoRA fit a 24 GB card. The matmuls still run in bf16 (or fp32): only storage is
8-bit. The upcast weight is a temporary of one Linear at a time; backward upcasts again instead of
keeping it, so no bf16 copy of the weights is ever held for the backward pass.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# model.base_dtype -> the storage dtype of the frozen block weights.
STORAGE = {"fp8": FP8, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
# The largest stored value a row's largest weight maps to. int8 stops at 127, not -128, so that
# a row's weights map symmetrically.
TOP = {FP8: FP8_MAX, torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max, torch.int8: 127.0}


# The matmul is a custom op with its own backward, opaque to torch.compile: compiled inside a
# block as one autograd.Function, AOTAutograd's partitioner saved the upcast bf16 weights for
# backward (seen with saved-tensor hooks), which would hold a bf16 copy of every weight.
# The op multiplies by the 8-bit weight cast to bf16 (exact: a plain cast, reading 1 byte and
# writing 2 per weight); the per-row scale is applied to the output outside the op,
# x @ (s * W8)^T = (x @ W8^T) * s, where a compiled block fuses it into its neighbours. On an
# H200 at FLUX.1-dev size, dequantizing through fp32 inside the op cost 0.12 s per image, and
# scaling the output inside it (an extra pass over the activations) 0.09.
@torch.library.custom_op("dpipe::fp8_matmul", mutates_args=())
def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x @ weight^T in `dtype`, weight in 8 bits; saves only the 8-bit weight for backward."""
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


class QuantizedLinear(nn.Module):
    """A frozen Linear with 8-bit weights (`storage`: float8_e4m3fn, float8_e5m2 or int8) and an
    fp32 scale per output row.

    `weight` stays a (frozen) Parameter under its Linear name, so checkpoints that leave out frozen
    parameters leave it out, and parameter counts are unchanged; `scale` is derived from it (not
    saved: it is recomputed from the base model's file on every start).
    """

    def __init__(self, linear: nn.Linear, storage: torch.dtype = FP8,
                 stored: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`stored`: (8-bit values, fp32 scale per row) as a file stores them, taken as they are
        (`storage` is then their dtype); else the Linear's weight is quantized here."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if stored is not None:
            q, scale = stored
            storage = q.dtype
        else:
            top = TOP[storage]
            w = linear.weight.detach().to(torch.float32)
            # Per-row scaling puts each row's largest weight at the format's largest value: rows
            # of very different magnitude (common in attention projections) each keep their
            # precision.
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / top
            q = (w / scale[:, None]).clamp(-top, top)
            if storage == torch.int8:
                q = q.round()  # to nearest: a plain cast would truncate toward zero
        self.storage = storage
        self.weight = nn.Parameter(q.to(storage), requires_grad=False)
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
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{str(self.storage).removeprefix('torch.')}")


def quantize_frozen_linears(denoiser: nn.Module, storage: torch.dtype = FP8,
                            make=None) -> int:
    """Replaces the frozen nn.Linear modules of the repeated blocks (every nn.ModuleList) with
    QuantizedLinear in `storage` (or what `make(linear)` returns), peft's LoRA `base_layer`s
    included; returns how many. Trainable Linears (LoRA's A and B) stay as they are. The embedders and the output head outside the blocks stay in the
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
                setattr(parent, name, make(child) if make else QuantizedLinear(child, storage))
                count += 1
    return count


def stored_as(linear: nn.Linear, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values, fp32 scale per row) of `linear` as the quantized single file it was read from
    stores it, where the file stores it in `storage` without a convrot rotation (its
    `stored_form`, `dpipe.models.single_file`): those bytes are the weight, with no second
    rounding; None elsewhere (the Linear's values are then quantized)."""
    form = linear.__dict__.get("stored_form")
    if form is None or form.group or form.values.dtype != storage:
        drop_stored_form(linear)  # its values are quantized: they must be there
        return None
    return form.values, form.scale


def drop_stored_forms(denoiser: nn.Module) -> None:
    """Frees the stored forms no Linear took (those outside the blocks, other formats)."""
    for module in denoiser.modules():
        drop_stored_form(module)


def drop_stored_form(module: nn.Module) -> None:
    """Frees `module`'s stored form; a weight read as a placeholder beside it
    (`StoredForm.weight_elided`) gets the form's values, which are the file's (bit for bit)."""
    form = module.__dict__.pop("stored_form", None)
    if form is not None and form.weight_elided:
        module.weight.data = form.dequantized().to(module.weight.dtype)


def quantize_for_compute(denoiser: nn.Module, compute: str, storage: torch.dtype, fast,
                         align: int, why: str | None) -> int:
    """`model.base_compute=<compute>`: the blocks' frozen Linears become `fast(linear, stored)`,
    which multiplies in 8 bits, where this process's device can (`why` is None, else the reason
    it cannot) and both their dimensions divide by `align`; the others keep `storage` weights and
    multiply in the compute dtype, as `model.base_dtype=<compute>` does. A Linear that a quantized
    file stores in `storage` keeps the file's bytes and scales (`stored_as`). Logs one line
    saying which; returns how many multiply in 8 bits."""
    log = logging.getLogger("dpipe")
    kept = []

    def stored(linear: nn.Linear):
        form = stored_as(linear, storage)
        kept.append(form is not None)
        return form

    if why:
        quantize_frozen_linears(denoiser, make=lambda linear: QuantizedLinear(
            linear, storage, stored=stored(linear)))
        drop_stored_forms(denoiser)
        log.info("model.base_compute=%s: %s; the frozen Linears keep %s weights and multiply "
                 "in bf16, as model.base_dtype=%s does%s", compute, why, compute, compute,
                 _file_bytes(kept))
        return 0
    fits = {True: 0, False: 0}

    def make(linear: nn.Linear) -> nn.Module:
        ok = linear.in_features % align == 0 and linear.out_features % align == 0
        fits[ok] += 1
        return fast(linear, stored(linear)) if ok else QuantizedLinear(linear, storage,
                                                                        stored=stored(linear))

    quantize_frozen_linears(denoiser, storage, make)
    drop_stored_forms(denoiser)
    rest = (f"; {fits[False]} with a dimension not divisible by {align} keep {compute} weights "
            "and multiply in bf16" if fits[False] else "")
    log.info("model.base_compute=%s: %d frozen Linears multiply in %s%s%s", compute, fits[True],
             compute, rest, _file_bytes(kept))
    return fits[True]


def _file_bytes(kept: list[bool]) -> str:
    return f" ({sum(kept)} of them the file's own bytes)" if any(kept) else ""


# The compute capability each 8-bit matmul of model.base_compute needs: fp8's `_scaled_mm` runs
# on Ada (8.9) and later; int8's `_int_mm` is checked on Ampere (8.0) and later.
MATMUL_CAPABILITY = {"fp8": ((8, 9), "Ada, Hopper, Blackwell"),
                     "int8": ((8, 0), "Ampere, Ada, Hopper, Blackwell")}


def matmul_support(device: torch.device, compute: str) -> str | None:
    """None where `device` multiplies in `compute` ("fp8", "int8"); else why not, in a few
    words. The CPU does: torch's CPU kernels run the same math (slowly), to test the path."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"no {compute} matmul on {device.type}"
    return capability_short_of(compute, torch.cuda.get_device_capability(device),
                               torch.cuda.get_device_name(device))


def capability_short_of(compute: str, capability: tuple[int, int], name: str) -> str | None:
    """Why the GPU `name` of `capability` has no `compute` matmul, None where it has."""
    needed, gpus = MATMUL_CAPABILITY[compute]
    if tuple(capability) >= needed:
        return None
    return (f"{name} (compute capability {capability[0]}.{capability[1]}) has no {compute} "
            f"matmul: it needs {needed[0]}.{needed[1]} or newer ({gpus})")


def compute_device() -> torch.device:
    """The device this process's matmuls run on: its CUDA GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
