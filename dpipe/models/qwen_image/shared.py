"""Helpers shared by the Qwen-Image, Z-Image and Lumina 2 families.

These three families are one owner's; what they share lives here rather than in each family
folder: the grad rule for stage outputs, masks from integer lengths, and saving tiny components in
the real repos' layout.
"""

from __future__ import annotations

from pathlib import Path

import torch


# ---- pipeline stage I/O -------------------------------------------------------------------------
def needs_grad(t: torch.Tensor) -> torch.Tensor:
    """A float tensor leaving a stage must take a gradient on the way back. Under LoRA the
    embedders are frozen, so their outputs carry none; a leaf that requires grad gives DeepSpeed's
    backward a valid end point (see docs on stage I/O)."""
    if torch.is_grad_enabled() and not t.requires_grad:
        return t.detach().requires_grad_()
    return t


def key_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) bool mask of the first `lengths[i]` positions, made on the lengths' device.
    Whether any mask is needed is decided where batches are made, on the CPU
    (`dpipe.models.attention_mask`): reading the lengths on a GPU would make the host wait."""
    return torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]


def weighted_labels(batch) -> tuple[torch.Tensor, ...]:
    """(target,) or, when the dataset gives per-pixel loss weights (masks, (B, 1, h, w) at latent
    resolution), (target, weight) for `dpipe.models.loss.weighted_mean`; the target is (B, C, h, w)."""
    weight = getattr(batch, "loss_weight", None)
    return (batch.target,) if weight is None else (batch.target, weight)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---- tiny models --------------------------------------------------------------------------------
def save_component(model: torch.nn.Module, directory: Path, shards: int, dtype: torch.dtype) -> None:
    """save_pretrained in `dtype`; with shards > 1, split into about that many files with an index
    file, as the real repos' large components are (a tensor is never split, so one dominating
    tensor can leave fewer files; never just one)."""
    # Plain nn.Module.to: diffusers' override warns about fp32-kept modules, which these have none of.
    torch.nn.Module.to(model, dtype)
    if shards == 1:
        model.save_pretrained(directory)
        return
    # One entry per storage: tied weights are written once.
    unique = {t.data_ptr(): t for t in model.state_dict().values()}.values()
    sizes = [t.numel() * t.element_size() for t in unique]
    cap = max(-(-sum(sizes) // shards), max(sizes))
    if cap >= sum(sizes):  # one tensor outweighs the rest: give it a file of its own
        cap = max(sizes)
    model.save_pretrained(directory, max_shard_size=cap)
