"""LTX-Video transformer weights under the original (Lightricks) names, as the single-file
checkpoints users download hold them (ltx-video-2b-v0.9.5.safetensors, ltxv-13b-0.9.7-dev
.safetensors, ...): the transformer under `model.diffusion_model.` (`patchify_proj`,
`adaln_single`, `transformer_blocks.N.attn1.q_norm`, ...) next to the VAE under `vae.`.

Reading is diffusers' `convert_ltx_transformer_checkpoint_to_diffusers` (it drops the `vae.` keys;
the VAE comes from the diffusers folder). `original_state_dict` is the inverse, for tests and
single-file export: LTX's original names differ from diffusers' in four words only.
"""

from __future__ import annotations

import torch
from torch import nn

# diffusers name part -> original, whole dot-separated components only.
_RENAMES = {"proj_in": "patchify_proj", "time_embed": "adaln_single", "norm_q": "q_norm",
            "norm_k": "k_norm"}


def from_original(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Original-named weights (the `model.diffusion_model.` prefix already stripped) -> diffusers
    names; the file's VAE weights are left out. Names already diffusers' convert to themselves."""
    from diffusers.loaders.single_file_utils import convert_ltx_transformer_checkpoint_to_diffusers

    return convert_ltx_transformer_checkpoint_to_diffusers(dict(state))


def original_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers LTXVideoTransformer3DModel state dict under the original names, without the
    `model.diffusion_model.` prefix the checkpoints add."""
    return {".".join(_RENAMES.get(part, part) for part in key.split(".")): value
            for key, value in weights.items()}
