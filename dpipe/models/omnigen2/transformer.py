"""OmniGen2's diffusion transformer, written for dpipe from the published architecture.

OmniGen2 (VectorSpaceLab/OmniGen2, arXiv 2506.18871, Apache-2.0 weights) ships its transformer as
`OmniGen2Transformer2DModel` in its own repository (omnigen2/models/transformers/
transformer_omnigen2.py); diffusers 0.42.1 has no class for it. This module is read from that
design, not copied: its state-dict keys, tensor shapes and config.json fields are the reference's
(a `transformer/` folder of OmniGen2/OmniGen2 loads with `from_pretrained`), which
`tests/unit/test_tiny_omnigen2.py` checks against a table written from the reference.

The blocks are Lumina-Image 2.0's (OmniGen2's transformer starts from Lumina 2's design): diffusers'
`Lumina2TransformerBlock` (grouped-query attention with q/k RMSNorm and complex RoPE, sandwich
RMSNorms, SwiGLU, tanh-gated adaLN from `norm1.linear`), run as
    caption -> context_refiner (no modulation, masked to each caption)
    image   -> x_embedder -> noise_refiner (modulated by t)
    [caption, image] per item -> layers -> norm_out -> the image tokens, unpatchified.
What differs from Lumina 2: the timestep is scaled by `timestep_scale` (1000 in the published
config) before its sinusoidal embedding; caption tokens sit at RoPE position (i, i, i) on all three
axes (Lumina 2: (i, 0, 0)), image tokens at (caption length, row, column); and the reference-image
path of editing and in-context generation (`ref_image_patch_embedder`, `ref_image_refiner`,
`image_index_embedding`, reference images' RoPE offsets), whose weights are here so that the
checkpoint loads whole, but whose forward is not written: text-to-image only.

Unlike the reference's forward, this one computes its RoPE frequencies itself (the reference
takes a `freqs_cis` table from its pipeline) and takes a batch tensor of latents of one size.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import LuminaLayerNormContinuous
from diffusers.models.transformers.transformer_lumina2 import Lumina2TransformerBlock
from torch import nn

from dpipe.models.common.lumina_layers import image_ids, image_tokens, join, joint_ids
from dpipe.models.common.shapes import patchify, unpatchify

ROPE_THETA = 10000.0
MAX_REFERENCE_IMAGES = 5  # rows of image_index_embedding


def rope_frequencies(ids: torch.Tensor, axes_dim: tuple[int, ...],
                     theta: float = ROPE_THETA) -> torch.Tensor:
    """(B, L, 3) integer positions -> (B, L, sum(axes_dim) / 2) complex128 rotations, per axis
    exp(i * position / theta^(2k / d)), as diffusers' `get_1d_rotary_pos_embed` tables them in
    float64 (the reference gathers from such tables)."""
    parts = []
    for axis, dim in enumerate(axes_dim):
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device)
                              [: dim // 2] / dim)
        angle = ids[..., axis].to(torch.float64)[..., None] * inv
        parts.append(torch.polar(torch.ones_like(angle), angle))
    return torch.cat(parts, dim=-1)


class OmniGen2Positions:
    """Caption token i at (i, i, i) on the three RoPE axes (Lumina 2: (i, 0, 0)); rotations
    computed from positions (`dpipe.models.common.lumina_layers.RotaryPositions`)."""

    def __init__(self, axes_dim: tuple[int, ...]):
        self.axes_dim = axes_dim

    def caption(self, length: int, batch: int, device: torch.device) -> torch.Tensor:
        pos = torch.arange(length, device=device)
        return pos[None, :, None].expand(batch, length, 3)

    def rotations(self, ids: torch.Tensor) -> torch.Tensor:
        return rope_frequencies(ids, self.axes_dim)


class OmniGen2TimeCaptionEmbedding(nn.Module):
    """The timestep's sinusoidal embedding (of t * timestep_scale) through a 2-layer MLP to
    min(hidden, 1024), and the caption's RMSNorm + Linear to the hidden size."""

    def __init__(self, hidden_size: int, text_feat_dim: int, norm_eps: float,
                 timestep_scale: float, frequency_embedding_size: int = 256):
        super().__init__()
        self.time_proj = Timesteps(num_channels=frequency_embedding_size, flip_sin_to_cos=True,
                                   downscale_freq_shift=0.0, scale=timestep_scale)
        self.timestep_embedder = TimestepEmbedding(in_channels=frequency_embedding_size,
                                                   time_embed_dim=min(hidden_size, 1024))
        self.caption_embedder = nn.Sequential(nn.RMSNorm(text_feat_dim, eps=norm_eps),
                                              nn.Linear(text_feat_dim, hidden_size, bias=True))

    def forward(self, timestep: torch.Tensor, text: torch.Tensor, dtype: torch.dtype):
        temb = self.timestep_embedder(self.time_proj(timestep).to(dtype))
        return temb, self.caption_embedder(text)


class OmniGen2Transformer2DModel(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """The reference's config fields and weights; forward for text-to-image (see the module)."""

    _supports_gradient_checkpointing = False
    _no_split_modules = ["Lumina2TransformerBlock"]

    @register_to_config
    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 16,
        out_channels: int | None = None,
        hidden_size: int = 2304,
        num_layers: int = 26,
        num_refiner_layers: int = 2,
        num_attention_heads: int = 24,
        num_kv_heads: int = 8,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        axes_dim_rope: tuple[int, int, int] = (32, 32, 32),
        axes_lens: tuple[int, int, int] = (300, 512, 512),
        text_feat_dim: int = 1024,
        timestep_scale: float = 1.0,
    ):
        super().__init__()
        if hidden_size // num_attention_heads != sum(axes_dim_rope):
            raise ValueError(f"hidden_size / num_attention_heads = "
                             f"{hidden_size // num_attention_heads} must equal sum(axes_dim_rope) "
                             f"= {sum(axes_dim_rope)}")
        self.out_channels = out_channels or in_channels
        patch_features = patch_size * patch_size * in_channels

        def block(modulation: bool) -> nn.Module:
            return Lumina2TransformerBlock(hidden_size, num_attention_heads, num_kv_heads,
                                           multiple_of, ffn_dim_multiplier, norm_eps,
                                           modulation=modulation)

        self.x_embedder = nn.Linear(patch_features, hidden_size)
        self.ref_image_patch_embedder = nn.Linear(patch_features, hidden_size)
        self.time_caption_embed = OmniGen2TimeCaptionEmbedding(hidden_size, text_feat_dim,
                                                               norm_eps, timestep_scale)
        self.noise_refiner = nn.ModuleList([block(True) for _ in range(num_refiner_layers)])
        self.ref_image_refiner = nn.ModuleList([block(True) for _ in range(num_refiner_layers)])
        self.context_refiner = nn.ModuleList([block(False) for _ in range(num_refiner_layers)])
        self.layers = nn.ModuleList([block(True) for _ in range(num_layers)])
        self.norm_out = LuminaLayerNormContinuous(
            embedding_dim=hidden_size, conditioning_embedding_dim=min(hidden_size, 1024),
            elementwise_affine=False, eps=1e-6, bias=True,
            out_dim=patch_size * patch_size * self.out_channels)
        self.image_index_embedding = nn.Parameter(torch.randn(MAX_REFERENCE_IMAGES, hidden_size))

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                text_hidden_states: torch.Tensor, text_attention_mask: torch.Tensor,
                ref_image_hidden_states=None, return_dict: bool = False):
        """(B, C, H, W) latents, t (B,) in [0, 1] with 1 the clean image, the MLLM's (B, L, D)
        hidden states and their (B, L) mask (1 = a real token, a prefix of each row) -> the
        predicted velocity clean - noise, (B, C, H, W)."""
        if ref_image_hidden_states is not None:
            raise NotImplementedError("dpipe's OmniGen2 transformer runs text-to-image only: "
                                      "reference images (editing) are not implemented")
        c = self.config
        p, positions = c.patch_size, OmniGen2Positions(tuple(c.axes_dim_rope))
        b, _, height, width = hidden_states.shape
        h, w = height // p, width // p
        mask = text_attention_mask.bool()
        cap_len = mask.sum(dim=1)
        temb, cap = self.time_caption_embed(timestep, text_hidden_states, hidden_states.dtype)
        cap_freqs = positions.rotations(positions.caption(cap.shape[1], b, cap.device))
        cap_freqs = cap_freqs * mask[..., None]  # zero past each caption, as the reference
        for layer in self.context_refiner:
            cap = layer(cap, mask, cap_freqs)
        x = self.x_embedder(patchify(hidden_states, p))
        img_freqs = positions.rotations(image_ids(cap_len, h, w))
        for layer in self.noise_refiner:
            x = layer(x, None, img_freqs, temb)
        joint, in_cap, in_img = join(cap, cap_len, x)
        freqs = positions.rotations(joint_ids(positions, cap_len, in_cap, in_img, h, w))
        real = in_cap | in_img
        for layer in self.layers:
            joint = layer(joint, real, freqs, temb)
        img = image_tokens(self.norm_out(joint, temb), cap_len, h, w)
        sample = unpatchify(img, h, w, p, self.out_channels)
        return (sample,) if not return_dict else {"sample": sample}
