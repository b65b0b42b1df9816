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
