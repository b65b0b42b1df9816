"""The padding-mask resize of diffusers' CosmosTransformer3DModel without torchvision.

The Cosmos transformers (Cosmos 1.0, Cosmos-Predict2) resize their padding mask to the latents
with torchvision (nearest), an optional dependency dpipe does not need. Every Cosmos family runs
the diffusers forward (its reference, its pipeline's sampler) inside `nearest_resize_without_torchvision`.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch.nn.functional as F


@contextlib.contextmanager
def nearest_resize_without_torchvision():
    """Without torchvision, lends diffusers' Cosmos transformer module the one operation it uses
    (torchvision's nearest resize of a tensor is `F.interpolate(mode="nearest")`); with
    torchvision, does nothing."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    import diffusers.models.transformers.transformer_cosmos as module

    class _Functional:
        @staticmethod
        def resize(x, size, interpolation=None):
            return F.interpolate(x, size=size, mode="nearest")

    class _Transforms:
        functional = _Functional

        class InterpolationMode:
            NEAREST = "nearest"

    had = hasattr(module, "transforms")
    previous = getattr(module, "transforms", None)
    module.transforms = _Transforms
    try:
        yield
    finally:
        if had:
            module.transforms = previous
        else:
            del module.transforms
