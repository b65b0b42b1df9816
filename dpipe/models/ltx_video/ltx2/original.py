"""LTX-2 transformer weights under the original (Lightricks) names, as the single-file checkpoints
users download hold them (ltx-2-19b-dev.safetensors, ltx-2.3-22b-dev.safetensors, ...): the
audio-video transformer under `model.diffusion_model.` (`patchify_proj`, `adaln_single`,
`av_ca_a2v_gate_adaln_single`, `transformer_blocks.N.attn1.q_norm`, ...) next to the video VAE
(`vae.`), the audio VAE and the vocoder, whose weights come from the diffusers folder instead.

Reading is diffusers' `convert_ltx2_transformer_to_diffusers` (renames only; no sizes), with
LTX-2.3's `prompt_adaln_single` / `audio_prompt_adaln_single` renamed here: the converter of
diffusers 0.42.1 knows LTX-2.0's names only. 2.3's other new weights (the blocks'
`prompt_scale_shift_table`s, the attentions' `to_gate_logits`) have the same names in both
layouts. The converter keeps every key it does not rename, so the other components' keys are left
out here: those whose first name is none of the transformer's own modules. `original_state_dict`
is the inverse, for tests and single-file export.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# diffusers name part -> original, whole dot-separated components only (the inverse of
# diffusers' substring renames).
_RENAMES = {
    "proj_in": "patchify_proj", "audio_proj_in": "audio_patchify_proj",
    "time_embed": "adaln_single", "audio_time_embed": "audio_adaln_single",
    "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
    "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
    "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
    "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single",
    "video_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_video",
    "audio_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_audio",
    "norm_q": "q_norm", "norm_k": "k_norm",
    # LTX-2.3's prompt modulation (diffusers 0.42.1's converter leaves these names as they are)
    "prompt_adaln": "prompt_adaln_single", "audio_prompt_adaln": "audio_prompt_adaln_single",
}
# Original top-level modules whose diffusers names the converter does not give (LTX-2.3's).
_FROM_ORIGINAL = {"prompt_adaln_single": "prompt_adaln",
                  "audio_prompt_adaln_single": "audio_prompt_adaln"}


def from_original(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Original-named weights (the `model.diffusion_model.` prefix already stripped) -> diffusers
    names; the file's VAE / audio VAE / vocoder weights are left out. Names already diffusers'
    convert to themselves."""
    converted = diffusers_names(state)
    own = {name.split(".", 1)[0] for name in model.state_dict()}
    return {k: v for k, v in converted.items() if k.split(".", 1)[0] in own}


def diffusers_names(state: dict[str, Any]) -> dict[str, Any]:
    """{diffusers name: value} of original-named keys (values of any kind: the converter only
    renames), every key kept."""
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    converted = convert_ltx2_transformer_to_diffusers(dict(state))
    return {".".join(_FROM_ORIGINAL.get(p, p) if i == 0 else p for i, p in enumerate(k.split("."))):
            v for k, v in converted.items()}


def original_module(name: str) -> str:
    """One diffusers module name (`proj_in`, `transformer_blocks.0.attn1.to_q`) under the
    original names, as ComfyUI's LTX-2 model names its weights."""
    return ".".join(_RENAMES.get(part, part) for part in name.split("."))


def original_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers LTX2VideoTransformer3DModel state dict under the original names, without the
    `model.diffusion_model.` prefix the checkpoints add."""
    return {".".join(_RENAMES.get(part, part) for part in key.split(".")): value
            for key, value in weights.items()}
