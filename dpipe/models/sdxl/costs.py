"""SDXL's stage-balancing costs (`layer_costs`): the forward FLOPs of each pipeline layer at a
1024x1024 image and a 77-token prompt, as torch's FlopCounterMode counts them.

Parameter counts, the default cost, misweigh a UNet's layers: a layer's work is its weights
times the pixels they run over, and those fall 4x at each downsampling. The resnets at the full
latent resolution hold the fewest weights and see the most pixels; the 10-transformer units at
the lowest hold the most and see the fewest.

Counted on fake tensors (`dpipe.models.spec.counted_layer_flops`), which carry shapes but no
memory and run no kernels: real size takes seconds on the CPU.
"""

from __future__ import annotations

import torch

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
