"""Chroma (Chroma1-HD / Chroma1-Base / Chroma1-Flash, and the v-numbered checkpoints in diffusers
format): ChromaTransformer2DModel + FLUX.1's AutoencoderKL (16 ch, shift and scale) + T5-XXL only.

A FLUX.1-schnell derivative: the per-block modulation layers are replaced by one small network
(the "approximator", `distilled_guidance_layer`) that maps the timestep to every block's
modulation vectors; there is no CLIP, no pooled text and no guidance embedding. Prompts are
embedded by diffusers' own `ChromaPipeline.encode_prompt`: T5 with its attention mask, and a mask
for the transformer that keeps the prompt's tokens plus exactly one padding token (Chroma's
training recipe). Objective: rectified flow, timestep t in [0, 1] (the model scales it by 1000).
The transformer may instead come from one file in the original layout (`Chroma1-HD.safetensors`,
with or without ComfyUI's `model.diffusion_model.`): model.path names the file and
model.single_file_config the diffusers folder that gives the VAE, T5 and configs (original.py).

Attention mask: training passes the mask to the transformer as booleans (True = attend), as Chroma
was trained and as ComfyUI runs it. diffusers 0.42.1's ChromaPipeline passes it as a float tensor,
which scaled_dot_product_attention adds to the scores instead of masking (huggingface/diffusers
issue #12116); a LoRA trained here therefore matches ComfyUI and the original model exactly, and
diffusers' pipeline only up to that masking difference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.models.attention_mask import has_padding, padding_mask, trim_text_padding
from dpipe.models.chroma.layers import ChromaDoubleBlock, ChromaSingleBlock, chroma_layers
from dpipe.models.chroma.original import from_original, original_state_dict
from dpipe.models.common.latent_packing import image_ids, pack, packed_labels
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.spec import NoisedBatch

# Every Linear of both kinds of blocks: attention (image and text projections), the MLPs, and the
# single blocks' fused MLP in/out. Chroma's blocks have no modulation Linears (the approximator
# outside the blocks produces them), so none are listed.
_BLOCK_LINEARS = [
    r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
    r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
    r"ff\.net\.0\.proj", r"ff\.net\.2", r"ff_context\.net\.0\.proj", r"ff_context\.net\.2",
    r"proj_mlp", r"proj_out",
]
LORA_TARGETS = r"(?:single_)?transformer_blocks\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"
# For ComfyUI: its Chroma model class subclasses its Flux class, whose LoRA loader maps
# diffusers' `transformer.<module>` names onto its own fused layout (q/k/v and the single blocks'
# linear1 included). ComfyUI applies such files at strength 1 (it reads no alpha from the
# metadata), so this copy has alpha / rank folded into lora_B; the diffusers file keeps them apart.
COMFYUI_LORA = "chroma_lora_comfyui.safetensors"


def comfyui_lora(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """diffusers-named LoRA weights (no prefix) -> `transformer.`-prefixed, scale folded in."""
    return {f"transformer.{k}": (v * scale if ".lora_B." in k else v).contiguous()
            for k, v in weights.items()}


class ChromaSpec(DiffusersFamily):
    family = "chroma"
    title, example = "Chroma", "lodestones/Chroma1-HD"
    pipeline_class, denoiser_class = "ChromaPipeline", "ChromaTransformer2DModel"
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer")
    text_fingerprint = {"t5": "text_encoder", "tokenizer": "tokenizer"}
    text_notes = {"mask": "prompt+1 pad"}
    latent_patch = 2
    tiny_writer = "dpipe.models.chroma.tiny:make_tiny_chroma"
    lora_modules = LORA_TARGETS
    layers, block_count_keys = chroma_layers, ("num_layers", "num_single_layers")
    block_types = (ChromaDoubleBlock, ChromaSingleBlock)
    sampler = "dpipe.models.chroma.sampling:ChromaSampling"
    # A single file: original names (original.py); the config from the folder.
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    # ComfyUI-GGUF's loader lists no Chroma name: its GGUFs carry FLUX.1's, or their own.
    gguf_architectures = ("flux", "chroma")
    from_single_file, to_original = from_original, original_state_dict

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        text, _ids, mask, *_negative = encoders.encode_prompt(
            prompts, device=encoders.vae.device, do_classifier_free_guidance=False,
            max_sequence_length=self.cfg.max_text_tokens)
        return {"t5": text, "mask": mask}

    # ---- training ----------------------------------------------------------------------------
    def make_inputs(self, batch: NoisedBatch):
        b, c, h, w = batch.latents.shape
        packed = pack(batch.noisy)
        # Cut after the longest prompt (and its one attended pad token): at one sample per
        # micro-batch no padding is left and no attention call gets a mask (attention_mask.py).
        text, text_mask = trim_text_padding(batch.text["t5"], batch.text["mask"] > 0.5)
        mask = text_mask.long()  # (B, 0) when nothing is left to mask
        if has_padding(text_mask):
            # The transformer's mask covers text then image tokens; every image token attends.
            mask = torch.cat([mask, torch.ones(b, packed.shape[1], dtype=torch.long)], dim=1)
        txt_ids = torch.zeros(text.shape[1], 3, dtype=torch.long)
        inputs = (packed, batch.timesteps, text, mask, txt_ids, image_ids(h // 2, w // 2))
        return inputs, packed_labels(batch)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFYUI_LORA, lambda: comfyui_lora(weights, lora_scale(metadata)))]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        packed, t, text, mask, txt_ids, img_ids = inputs
        return denoiser(hidden_states=packed, encoder_hidden_states=text, timestep=t,
                        img_ids=img_ids.float(), txt_ids=txt_ids.float(),
                        attention_mask=padding_mask(mask), return_dict=False)[0]
