"""Helpers for pipeline layers that keep the host from waiting for the GPU.

Reading a tensor's values on a GPU (`.tolist()`, `int(t)`, a tensor used as a size, indexing by a
boolean mask, whose result's size depends on the values) makes the host wait until the GPU has run
everything queued: a host sync in every layer that does it, for every micro-batch, after which the
GPU waits for the host to queue new work.

- Integers that layers need on the host (a latent grid's size) go from layer to layer as the shape
  of an empty tensor, a `carrier`: a shape lives on the host, so `sizes(t)` costs nothing. Between
  pipeline stages the shapes of each micro-batch's tensors travel host to host
  (`dpipe/pipeline/stage_engine.py`), so a carrier crosses stages like any tensor, with no data.
- Tokens reordered by a mask (valid ones first) are sorted on the GPU: `valid_first`.
- Tables a layer computes on the host once per shape (and then keeps on the device) are built
  under `on_host()`, which the CPU audit of host syncs (dpipe.train.audit) does not count: their
  values are read from host tensors, which syncs nothing.

`tests/integration/test_families.py` runs every family's layers on the meta device, where any
read of a tensor's values fails.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import _disable_current_modes


def carrier(*values: int, device: torch.device | None = None) -> torch.Tensor:
    """An int64 tensor of shape (*values, 0): no elements, the values in its shape."""
    return torch.empty((*(int(v) for v in values), 0), dtype=torch.long, device=device)


def sizes(t: torch.Tensor) -> tuple[int, ...]:
    """The values of a `carrier`."""
    assert t.numel() == 0 and t.shape[-1] == 0, f"not a carrier: a tensor of shape {tuple(t.shape)}"
    return tuple(t.shape[:-1])


def valid_first(tokens: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, C) tokens and their (B, N) bool mask, reordered per sample: the valid tokens, then
    the others, each group in its original order (a stable sort on "not valid")."""
    _, order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True)
    return (torch.gather(tokens, 1, order[..., None].expand_as(tokens)),
            torch.gather(valid, 1, order))


@contextlib.contextmanager
def on_host():
    """Marks host-side work inside a layer: host tensors only, nothing read from the device."""
    with _disable_current_modes():
        yield
