"""A layer call that recomputes the layer's activations in backward (activation checkpointing).

Eager layers go through torch.utils.checkpoint. A compiled layer is checkpointed inside its
compiled graph instead, so that torch.compile keeps the layer's inputs and replays the forward in
the backward graph itself. Wrapped the other way round, an eager checkpoint around the compiled
call, the recomputation must save the very tensors of the forward in the same order, and on a GPU
Wan's compiled blocks did not: their first backward failed with torch.utils.checkpoint's
"Recomputed values for the following tensors have different metadata" (tiny and 14B, with
either attention kernel; FLUX's blocks were fine; docs/bench-results/h200-1gpu-checkpoint-compile).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def recomputed(layer: nn.Module, x):
    """`layer(x)`, keeping only `x` for backward; inside the compiled graph where the layer is
    nn.Module.compile()'d."""
    compiled = getattr(layer, "_compiled_call_impl", None) is not None
    return (_checkpointed_compiled if compiled else _checkpointed)(layer, x)


def _checkpointed(layer: nn.Module, x):
    # The layer's own forward, not its compiled one: under _checkpointed_compiled this is what
    # gets compiled.
    return checkpoint(layer._call_impl, x, use_reentrant=False)


# One compiled function serves every layer: dynamo guards on the layer's class and structure, not
# its identity (its weights are graph inputs), so like blocks share their graphs. These graphs are
# compiled apart from the layers' own, and `auto` meets both in its first step: FLUX.1-dev's first
# step took 125 s instead of 77 on an H200 (fp8 weights, 24 GiB budget), once.
_checkpointed_compiled = torch.compile(_checkpointed)


def offloaded(layer: nn.Module, x):
    """`layer(x)` recomputed in backward like `recomputed`, with `x` kept in host memory (pinned,
    on CUDA) between the forward and the recompute instead of on the device
    (`pipeline.activation_checkpointing=offload`). Integer tensors (position ids) stay where
    they are.

    A custom autograd function rather than torch.utils.checkpoint, whose recompute keeps its
    inputs on the device: forward runs the layer without a graph and copies the float inputs to
    the host on the compute stream (ordered before any reuse of their memory, no host sync);
    backward copies them back, re-runs the layer under the forward's autocast and RNG state, and
    backpropagates through that fresh graph. A compiled layer is called as it is, once without
    grad and once with (two graphs of the same layer: no checkpoint metadata to match)."""
    single = torch.is_tensor(x)
    inputs = (x,) if single else tuple(x)
    trains = any(q.requires_grad for q in layer.parameters())
    if not trains and not any(t.requires_grad for t in inputs):
        return layer(x)  # backward never reaches it: there is nothing to keep
    # A function's outputs need a gradient only where one of its inputs does: an empty tensor
    # that does stands for the layer's trainable weights (their gradients accumulate in
    # backward's recompute, not through this input).
    anchor = torch.empty(0, device=inputs[0].device, requires_grad=trains)
    returns_tensor: list[bool] = []  # the function returns a tuple; the layer may not
    outputs = _Offloaded.apply(layer, (single, returns_tensor), anchor, *inputs)
    return outputs[0] if returns_tensor[0] else outputs


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t.detach().clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    return host


class _Offloaded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, kinds, anchor, *inputs):
        device = inputs[0].device
        (single, returns_tensor) = kinds
        ctx.layer, ctx.single, ctx.device = layer, single, device
        ctx.autocast = (torch.is_autocast_enabled(device.type),
                        torch.get_autocast_dtype(device.type))
        ctx.rng = (torch.get_rng_state(),
                   torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        ctx.inputs = [_to_host(t) if t.is_floating_point() else t for t in inputs]
        out = layer(inputs[0] if single else tuple(inputs))
        outputs = (out,) if torch.is_tensor(out) else tuple(out)
        returns_tensor.append(torch.is_tensor(out))
        ctx.mark_non_differentiable(*[t for t in outputs if not t.is_floating_point()])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        device = ctx.device
        inputs = [(t.to(device, non_blocking=True).requires_grad_(need)
                   if t.is_floating_point() else t)
                  for t, need in zip(ctx.inputs, ctx.needs_input_grad[3:])]
        ctx.inputs = None
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.set_rng_state(ctx.rng[0])
            if cuda:
                torch.cuda.set_rng_state(ctx.rng[1], device)
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(device.type, dtype=dtype, enabled=enabled):
                out = ctx.layer(inputs[0] if ctx.single else tuple(inputs))
        outputs = (out,) if torch.is_tensor(out) else tuple(out)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *[t.grad if torch.is_tensor(t) and t.requires_grad else None
                              for t in inputs])
