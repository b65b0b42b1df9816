"""Pipeline stage I/O: what a layer must do to the tensors it hands to the next stage.

A pipeline layer takes and returns a tuple of tensors; DeepSpeed sends the tuple between stages
and runs each stage's backward from the gradients of the float tensors it sent. Under LoRA the
embedders are frozen, so their outputs carry no gradient and the first stage's backward would have
no end point: `needs_grad` gives it one. Integers travel as carriers (`dpipe.models.sync_free`);
text padding masks are built from carried lengths (`dpipe.models.attention_mask`).
"""

from __future__ import annotations

import torch


def needs_grad(t: torch.Tensor) -> torch.Tensor:
    """A float tensor leaving a stage must take a gradient on the way back: one that carries none
    (a frozen embedder's output, an input) becomes a leaf that requires grad, a valid end point
    for DeepSpeed's backward. Outside autograd (sampling) it is returned as is."""
    if torch.is_grad_enabled() and not t.requires_grad:
        return t.detach().requires_grad_()
    return t


def keep_in_graph(out: torch.Tensor, *unused: torch.Tensor) -> torch.Tensor:
    """`out`, with the tensors a layer received but did not read (text it passes on, a
    modulation) joined to its graph at zero weight: DeepSpeed runs a stage's backward from the
    gradients of every float tensor it sent, and one that led nowhere would fail it. Exact: the
    sum of zeros changes no value and no gradient."""
    return out + 0.0 * sum(t.sum() for t in unused)
