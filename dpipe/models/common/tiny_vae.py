"""The tiny AutoencoderKL of the families that use FLUX.1's VAE design: no 1x1 quant convs, and a
latent scale and shift (FLUX.1, Chroma, HiDream-I1, Z-Image, Lumina 2, OmniGen2: FLUX.1's own
VAE; SD3: its own scale and shift)."""

from __future__ import annotations

FLUX_SCALE, FLUX_SHIFT = 0.3611, 0.1159
# Three levels downscale 4x, which keeps the tiny models' images small; four levels downscale 8x,
# as the real VAE, for pipelines that hard-code that factor (Lumina 2, OmniGen2).
LEVEL_CHANNELS = {3: (16, 32, 32), 4: (8, 16, 16, 16)}


def tiny_flux_vae(latent_channels: int, levels: int = 3, scaling_factor: float = FLUX_SCALE,
                  shift_factor: float = FLUX_SHIFT):
    """A random tiny VAE (seed the caller's RNG first: its weights are drawn here)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=LEVEL_CHANNELS[levels], layers_per_block=1, norm_num_groups=8,
        act_fn="silu", sample_size=64, force_upcast=True, mid_block_add_attention=True,
        scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False)
