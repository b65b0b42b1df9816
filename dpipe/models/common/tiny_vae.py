"""The tiny VAEs that several families share: the AutoencoderKL of FLUX.1's VAE design, no 1x1
quant convs and a latent scale and shift (FLUX.1, Chroma, HiDream-I1, Z-Image, Lumina 2,
OmniGen2: FLUX.1's own VAE; SD3: its own scale and shift), and the same design as the SDXL VAE
(SDXL, AuraFlow: quant convs, SDXL's scale, no shift); FLUX.2's; Qwen-Image's."""

from __future__ import annotations

FLUX_SCALE, FLUX_SHIFT = 0.3611, 0.1159
# Three levels downscale 4x, which keeps the tiny models' images small; four levels downscale 8x,
# as the real VAE, for pipelines that hard-code that factor (Lumina 2, OmniGen2).
LEVEL_CHANNELS = {3: (16, 32, 32), 4: (8, 16, 16, 16)}


def tiny_flux_vae(latent_channels: int, levels: int = 3, scaling_factor: float = FLUX_SCALE,
                  shift_factor: float | None = FLUX_SHIFT, quant_convs: bool = False):
    """A random tiny VAE (seed the caller's RNG first: its weights are drawn here)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=LEVEL_CHANNELS[levels], layers_per_block=1, norm_num_groups=8,
        act_fn="silu", sample_size=64, force_upcast=True, mid_block_add_attention=True,
        scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=quant_convs, use_post_quant_conv=quant_convs)


def tiny_sdxl_vae():
    """The tiny VAE of SDXL's design: 4 latent channels, SDXL's scale, quant convs, no shift."""
    return tiny_flux_vae(4, scaling_factor=0.13025, shift_factor=None, quant_convs=True)


def tiny_flux2_vae(latent_channels: int):
    """A random tiny AutoencoderKLFlux2 (FLUX.2, ERNIE-Image, Ideogram 4: seed the caller's RNG
    first). Its BatchNorm statistics, which the pipelines normalise the 2x2-patched latents
    with, are random too: a missing or wrong normalisation shows."""
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 32), layers_per_block=1, norm_num_groups=8,
        sample_size=64, use_quant_conv=True, use_post_quant_conv=True)
    vae.bn.running_mean.copy_(0.3 * torch.randn(4 * latent_channels))
    vae.bn.running_var.copy_(0.5 + torch.rand(4 * latent_channels))
    return vae


def tiny_qwen_image_vae(z_dim: int):
    """A random tiny AutoencoderKLQwenImage (Qwen-Image, Krea 2: seed the caller's RNG first):
    two levels, 4x (the real VAE: three, 8x), with the real VAE's first channels' statistics."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=16, z_dim=z_dim, dim_mult=[1, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
        latents_std=[2.8184, 1.4541, 2.3275, 2.6558])
