"""SDXL's stage-balancing costs (`layer_costs`): the forward FLOPs of each pipeline layer at a
1024x1024 image and a 77-token prompt, as torch's FlopCounterMode counts them.

Parameter counts, the default cost, misweigh a UNet's layers: a layer's work is its weights
times the pixels they run over, and those fall 4x at each downsampling. The resnets at the full
latent resolution hold the fewest weights and see the most pixels; the 10-transformer units at
the lowest hold the most and see the fewest.

Counted on fake tensors, which carry shapes but no memory and run no kernels: real size takes
seconds on the CPU. Attention goes through SDPA's math path, whose matmuls the counter counts;
its fused CPU kernel is left out of the count.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dpipe.models.spec import PipelineLayer

NOMINAL_PIXELS = 1024  # SDXL's training resolution
NOMINAL_TEXT_TOKENS = 77  # CLIP's context: every SDXL prompt embedding has this length


def nominal_inputs(unet_config, vae_scale: int, device: torch.device,
                   pixels: int = NOMINAL_PIXELS) -> tuple[torch.Tensor, ...]:
    """One sample's layer inputs (latents, timestep, text, pooled text, time ids) at an image
    of `pixels` square."""
    side = pixels // vae_scale
    pooled = (unet_config["projection_class_embeddings_input_dim"]
              - 6 * unet_config["addition_time_embed_dim"])
    size = float(pixels)
    return (torch.zeros(1, unet_config["in_channels"], side, side, device=device),
            torch.full((1,), 500.0, device=device),
            torch.zeros(1, NOMINAL_TEXT_TOKENS, unet_config["cross_attention_dim"], device=device),
            torch.zeros(1, pooled, device=device),
            torch.tensor([[size, size, 0.0, 0.0, size, size]], device=device))


def counted_layer_flops(layers: list[PipelineLayer], inputs: tuple[torch.Tensor, ...],
                        fake: bool = True) -> list[float]:
    """Forward FLOPs of each layer on `inputs`, passed from layer to layer. `fake`: on fake
    copies of the inputs (no compute); otherwise on the tensors themselves."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    flops = []
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), mode or contextlib.nullcontext():
        x = tuple(mode.from_tensor(t) for t in inputs) if mode else inputs
        for layer in layers:
            with FlopCounterMode(display=False) as counter:
                x = layer(x)
            flops.append(float(counter.get_total_flops()))
    return flops
