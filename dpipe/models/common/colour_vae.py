"""A tiny AutoencoderKL that really encodes pictures: its latent is the picture's colours at a
quarter of the size (each latent pixel holds the mean R, G, B and grey, R/4 + G/2 + B/4, of a
4x4 patch) and its decoder paints them back, so a decoded latent is a picture. The demo's model
(tiny FLUX.1) uses it: with a random VAE no sample could ever show what the model learnt.

Its weights are set, not trained: deterministic, made in milliseconds, and exact (on the
synthetic shapes only the edges, blurred to the 4x4 patches, differ from the input). The layout
is FLUX.1's VAE design (no quant convs, a latent scale and shift, a mid-block with attention), in
diffusers' AutoencoderKL, so FluxPipeline loads it with its default arguments.

How a linear map passes the blocks that are not linear:
- Every ResnetBlock2D and attention adds its branch to its input: a zero last layer makes it the
  identity.
- A GroupNorm removes each group's mean and scale. Each signal s rides in a group of four
  channels (s, -s, K, -K): the group's mean is 0 and its variance (mean(s^2) + K^2) / 2 is K^2/2
  to within mean(s^2) / 2K^2 (under 0.05% for |s| <= 1, K = 32), so the norm passes s scaled by
  sqrt(2)/K, almost exactly.
- SiLU(y) = y / (1 + e^-y) is y to within 1.2e-3 for y in [9, 11]: the norm's bias lifts s by
  10 into that range and the next conv's bias takes it off again.
"""

from __future__ import annotations

import math

import torch

CHANNELS = 16  # four groups of four: R, G, B, and a constant group
GROUPS = 4
K = 32.0  # the constant channels' value: large against any |s| <= 1 (see the docstring)
LIFT = 10.0  # where a signal enters SiLU, which is nearly linear there
LATENT_CHANNELS = 4  # R, G, B and grey
# The synthetic shapes' latents (dpipe.data.synthetic, images 0-511 of seed 0) have mean 0.0593 and
# standard deviation 0.6155: this shift and scale make them zero-mean and unit-variance, as
# FLUX.1's own factors do for photos.
SHAPES_SHIFT, SHAPES_SCALE = 0.0593, 1.625  # 1.625 = 1 / 0.6155


def colour_flux_vae(scaling_factor: float = SHAPES_SCALE, shift_factor: float = SHAPES_SHIFT):
    """The colour autoencoder, with a latent scale and shift (default: the synthetic shapes')."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(CHANNELS,) * 3, layers_per_block=1, norm_num_groups=GROUPS,
        act_fn="silu", sample_size=64, force_upcast=True, mid_block_add_attention=True,
        scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False)
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        _set_encoder(vae.encoder)
        _set_decoder(vae.decoder)
    return vae


def _set_encoder(encoder) -> None:
    # conv_in: RGB -> (s, -s, K, -K) per colour, and a constant group
    _carry_signals(encoder.conv_in, torch.eye(3))
    for block in encoder.down_blocks:
        for sampler in block.downsamplers or []:
            # A 3x3 stride-2 conv over a (0, 1, 0, 1)-padded input: the top-left 2x2 taps
            # average each 2x2 patch, and never reach the padding.
            w = sampler.conv.weight
            for c in range(CHANNELS):
                w[c, c, :2, :2] = 0.25
    # conv_norm_out + SiLU + conv_out: the latent's means are the colours and their grey;
    # its log-variances are -30 (the lowest the distribution allows): sampling is the mean.
    mix = torch.cat([torch.eye(3), torch.tensor([[0.25, 0.5, 0.25]])])
    _read_signals(encoder.conv_norm_out, encoder.conv_out, mix)
    encoder.conv_out.bias[LATENT_CHANNELS:] = -30.0


def _set_decoder(decoder) -> None:
    # conv_in: the latent's R, G, B (grey is not read) -> (s, -s, K, -K) groups
    _carry_signals(decoder.conv_in, torch.eye(3, LATENT_CHANNELS))
    for block in decoder.up_blocks:
        for sampler in block.upsamplers or []:
            # nearest-neighbour doubling, then a conv that passes each channel through
            w = sampler.conv.weight
            for c in range(CHANNELS):
                w[c, c, 1, 1] = 1.0
    _read_signals(decoder.conv_norm_out, decoder.conv_out, torch.eye(3))


def _carry_signals(conv, mix: torch.Tensor) -> None:
    """`conv` (its centre tap) writes signal i = mix[i] . input into group i as (s, -s, K, -K),
    and K, -K into the groups beyond the signals."""
    if mix.shape[0] >= GROUPS:
        raise ValueError("no group is left for the constant channels")
    for group in range(GROUPS):
        first = 4 * group
        if group < mix.shape[0]:
            conv.weight[first, :mix.shape[1], 1, 1] = mix[group]
            conv.weight[first + 1, :mix.shape[1], 1, 1] = -mix[group]
        conv.bias[first + 2], conv.bias[first + 3] = K, -K


def _read_signals(norm, conv, mix: torch.Tensor) -> None:
    """`norm` + SiLU + `conv` (its centre tap): output j = mix[j] . signals (group i's s)."""
    gain = K / math.sqrt(2)  # undoes the norm's 1/sqrt(K^2/2); the output's own scale is 1
    for group in range(mix.shape[1]):
        norm.weight[4 * group] = gain
        norm.bias[4 * group] = LIFT
    for out in range(mix.shape[0]):
        for group in range(mix.shape[1]):
            conv.weight[out, 4 * group, 1, 1] = mix[out, group]
        conv.bias[out] = -LIFT * mix[out].sum()
