"""MiniMax H3's original layout: the single files (Comfy-Org/MiniMax-H3's diffusion_models/*,
the names of MiniMax's reference code, which ComfyUI loads) and ComfyUI LoRAs.

The original names differ from diffusers' as diffusers' own converter
(`convert_minimax_h3_transformer_checkpoint_to_diffusers`, "stacked" q/k/v as the published
single files hold them) reads them: `blocks.N` for `transformer_blocks.N`, one `attn.qkv_proj`
stacking q, k and v, `attn.q_norm`/`k_norm`/`out_proj`, `mlp.fc1` holding the SwiGLU's
(gate, value) halves where diffusers' `ff.net.0.proj` holds (value, gate), `mlp.fc2`;
`token_refiner.blocks.N`; `video_patch_proj`, `audio_patch_proj`, `condition_proj`,
`time_embedder.proj_in`/`proj_out`; `final_layer.norm`/`adaln_proj.linear`/`video_out`/
`audio_out`. One table (`layout`) gives both directions (`common.key_tables`) and the ComfyUI
LoRA's modules (`comfyui.to_comfyui`: q, k, v folded into one fused qkv LoRA, fc1's B halves
swapped).
"""

from __future__ import annotations

import torch

from dpipe.models.comfyui import to_comfyui
from dpipe.models.common.key_tables import FusedLinear, from_original, to_original

_OUTSIDE_BLOCKS = [  # (original module, diffusers module)
    ("video_patch_proj", "proj_in"), ("audio_patch_proj", "audio_proj_in"),
    ("condition_proj", "context_embedder"), ("time_embedder.proj_in", "time_embedder.linear_1"),
    ("time_embedder.proj_out", "time_embedder.linear_2"),
    ("final_layer.adaln_proj.linear", "norm_out.linear"), ("final_layer.video_out", "proj_out"),
    ("final_layer.audio_out", "audio_proj_out"),
]


def layout(config) -> tuple[list[FusedLinear], dict[str, str], set[str]]:
    """(fused Linear rows, one-to-one parameter renames {original: diffusers}, modules whose
    halves are swapped) of a MiniMaxH3Transformer3DModel config."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    fused: list[FusedLinear] = [(o, [d], [None]) for o, d in _OUTSIDE_BLOCKS]
    renames = {"token_refiner.final_norm.weight": "token_refiner.final_norm.weight",
               "final_layer.norm.weight": "norm_out.norm.weight"}
    swapped = set()
    stacks = [("blocks", "transformer_blocks", config["num_layers"], True),
              ("token_refiner.blocks", "token_refiner.refiner_blocks",
               config["num_refiner_layers"], False)]
    for original_stack, stack, count, modulated in stacks:
        for i in range(count):
            o, d = f"{original_stack}.{i}", f"{stack}.{i}"
            fused += [
                (f"{o}.attn.qkv_proj", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"],
                 [inner] * 3),
                (f"{o}.attn.out_proj", [f"{d}.attn.to_out.0"], [None]),
                (f"{o}.mlp.fc1", [f"{d}.ff.net.0.proj"], [None]),
                (f"{o}.mlp.fc2", [f"{d}.ff.net.2"], [None]),
            ]
            if modulated:
                fused.append((f"{o}.adaln_proj.linear", [f"{d}.adaln_proj.linear"], [None]))
            swapped.add(f"{o}.mlp.fc1")
            for norm in ("norm1", "norm2"):
                renames[f"{o}.{norm}.weight"] = f"{d}.{norm}.weight"
            for norm in ("q_norm", "k_norm"):
                renames[f"{o}.attn.{norm}.weight"] = f"{d}.attn.norm_{norm[0]}.weight"
    return fused, renames, swapped


def original_state_dict(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Diffusers-named transformer weights -> the original names (no prefix), with the rotary
    frequencies `rope.inv_freq` (fp32) that the published files hold and diffusers computes:
    ComfyUI 0.33.0 tells a MiniMax H3 file by that key and sizes its buffer from it
    (`comfy/model_detection.py`)."""
    fused, renames, swapped = layout(config)
    out = to_original(state, fused, "MiniMax H3 original", renames, swapped)
    out["rope.inv_freq"] = rope_inv_freq(config)
    return out


def rope_inv_freq(config) -> torch.Tensor:
    """MiniMaxH3RotaryPosEmbed's `inv_freq`: `rope_freq_dim` frequencies theta^(-2i / 2F)."""
    dim = config.get("rope_freq_dim", 16)
    theta = config.get("rope_theta", 10000.0)
    return 1.0 / theta ** (torch.arange(0, 2 * dim, 2, dtype=torch.float32) / (2 * dim))


def diffusers_state_dict(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Original-named weights (a single file, its prefix removed) -> diffusers names."""
    fused, renames, swapped = layout(config)
    state = {k: v for k, v in state.items() if k != "rope.inv_freq"}  # computed, not loaded
    if "adaln_t_table" in state:
        raise ValueError("a pruned checkpoint (adaln_t_table in place of time_embedder): use "
                         "the unpruned MiniMaxAI/MiniMax-H3 transformer")
    return from_original(state, fused, renames, swapped)


def lora_to_comfyui(weights: dict[str, torch.Tensor], scale: float,
                    config) -> dict[str, torch.Tensor]:
    """A diffusers-named LoRA -> ComfyUI's names (`diffusion_model.` + the original modules)."""
    fused, _, swapped = layout(config)
    return to_comfyui(weights, scale, fused, swapped)
