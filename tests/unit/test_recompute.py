"""Activation checkpointing of eager and compiled layers (dpipe.pipeline.recompute)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpipe.pipeline.recompute import recomputed

pytestmark = pytest.mark.slow  # compiles on the CPU (~20 s)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _saved_shapes(call) -> tuple[torch.Tensor, list[torch.Size]]:
    """The call's output and the shapes of the tensors autograd saved for its backward."""
    shapes = []

    def pack(t):
        shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    return out, shapes


def _grads(block, out):
    out.square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    return grads


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_recomputed_layer_trains_as_the_plain_one_and_keeps_no_activation(compiled):
    torch.manual_seed(0)
    block, x = Block(), torch.randn(3, 8, requires_grad=True)
    plain, plain_saved = _saved_shapes(lambda: block(x))
    plain_grads = _grads(block, plain)
    if compiled:
        block.compile()
    out, saved = _saved_shapes(lambda: recomputed(block, x))
    torch.testing.assert_close(out, plain)
    for got, want in zip(_grads(block, out), plain_grads):
        torch.testing.assert_close(got, want)
    hidden = torch.Size([3, 32])  # the activation between the Linears
    assert hidden in plain_saved and hidden not in saved
    if compiled:  # the compiled graph itself keeps its inputs, weights included, and recomputes
        assert set(saved) <= {x.shape, *(q.shape for q in block.parameters())}
        assert block.up.weight.shape in saved  # needed only to recompute `up`'s output
    else:  # torch.utils.checkpoint keeps the input
        assert saved == [x.shape]
