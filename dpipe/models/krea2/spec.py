"""Krea 2: Krea2Transformer2DModel + AutoencoderKLQwenImage + Qwen3-VL text encoder.

Loads the diffusers folder layout `Krea2Pipeline.save_pretrained` writes. Prompts go through the
pipeline's own `encode_prompt`: the Qwen-Image template padded to a fixed length in the middle
([prefix | prompt | PAD | suffix], the 34 prefix tokens dropped) and the stack of the
`text_encoder_select_layers` hidden states per token, cached as they are with the pipeline's mask.

Conventions, from `Krea2Pipeline.__call__`: latents are normalised per channel with the VAE's
latents_mean / latents_std (the pipeline decodes `x * std + mean`) and packed in 2x2 patches;
the transformer gets sigma in [0, 1] (t / 1000) and predicts the flow velocity noise - x0, which
the Euler flow-matching scheduler steps with (dpipe's default objective).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.errors import ModelLoadError
from dpipe.models.comfyui import diffusers_named
from dpipe.models.common.latent_packing import pack, packed_labels
from dpipe.models.diffusers_folder import read_json, wan_vae_image_latents
from dpipe.models.family import DiffusersFamily
from dpipe.models.krea2.layers import Krea2Block, Krea2Embed, krea2_layers
from dpipe.models.krea2.original import original_state_dict
from dpipe.models.krea2.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.lora_files import LoraFormat
from dpipe.models.spec import (
    EDGE_LAYER_TIME, NoisedBatch, PipelineLayer, joint_attention_train_flops)
from dpipe.models.sync_free import carrier

# Every Linear of every Krea2TransformerBlock: the gated attention's projections and the SwiGLU.
LORA_TARGETS = (r"transformer_blocks\.\d+\.(?:attn\.(?:to_q|to_k|to_v|to_gate|to_out\.0)"
                r"|ff\.(?:gate|up|down))")

COMFYUI_LORA = "krea2_lora_comfyui.safetensors"

# The embedding layer's time relative to a main block (layer_costs): estimated, not measured.
EMBED_COST = 0.5


class Krea2Spec(DiffusersFamily):
    family = "krea2"
    title, example = "Krea 2", "a Krea 2 checkpoint converted to diffusers"
    pipeline_class, denoiser_class = "Krea2Pipeline", "Krea2Transformer2DModel"
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer",
                      "scheduler")
    # Normalised per channel with the VAE's statistics (see encode_images).
    image_latents = wan_vae_image_latents  # a video VAE: one frame
    vae_config_keys = ("latents_mean", "latents_std")
    latent_patch = 2
    tiny_writer = "dpipe.models.krea2.tiny:make_tiny_krea2"
    lora_modules = LORA_TARGETS
    # krea-ai's names of the Linears, as the single files ComfyUI loads hold them: dpipe reads
    # no Krea 2 single file, but `dpipe-lora merge` places Krea 2 LoRAs on one through them.
    to_original = staticmethod(original_state_dict)
    layers = krea2_layers
    sampler = "dpipe.models.krea2.sampling:Krea2Sampling"

    def _index(self) -> dict[str, Any]:
        return read_json(self.path / "model_index.json")

    @property
    def text_notes(self) -> dict[str, Any]:
        # The tapped text-encoder layers are the pipeline's, named in model_index.json.
        return {"select_layers": self._index().get("text_encoder_select_layers"),
                "layout": "pipeline encode_prompt: fixed length, tapped layers stacked, mask"}

    def read_configs(self) -> None:
        if self._index().get("patch_size", 2) != 2:
            raise ModelLoadError(f"{self.path}/model_index.json: patch_size "
                                 f"{self._index()['patch_size']}; dpipe trains Krea 2 with 2x2 "
                                 "patches, as released")
        super().read_configs()

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        # Every prompt encodes to exactly max_text_tokens (the pipeline's fixed-length block),
        # so the cache keeps the pipeline's tensors as they are.
        embeds, mask = encoders.encode_prompt(
            list(prompts), device=encoders.vae.device,
            max_sequence_length=self.cfg.max_text_tokens)
        return {"text": embeds, "text_mask": mask.float()}

    # ---- training ----------------------------------------------------------------------------
    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """A block 1, the head EDGE_LAYER_TIME, the embedding EMBED_COST: its text fusion runs
        4 blocks of the text width (2560), two of them over 12 tapped layers x 512 tokens, about
        half a main block's FLOPs at 1024x1024 (parameter counts would put it on a stage alone
        in the tiny model, whose text fusion outweighs its blocks)."""
        return [EMBED_COST if isinstance(layer, Krea2Embed) else
                1.0 if isinstance(layer, Krea2Block) else EDGE_LAYER_TIME for layer in layers]

    def make_inputs(self, batch: NoisedBatch):
        b, c, h, w = batch.latents.shape
        text = batch.text
        inputs = (pack(batch.noisy), batch.timesteps, text["text"],
                  text["text_mask"].round().long(), carrier(h // 2, w // 2))
        return inputs, packed_labels(batch)

    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        # ComfyUI 0.33.0 maps Krea 2 LoRAs by diffusers' module names under `diffusion_model.`
        # onto its original-named model (comfy/lora.py, comfy/utils.py krea2_to_diffusers).
        return [LoraFormat(COMFYUI_LORA, lambda: diffusers_named(weights, metadata["lora_alpha"]),
                           {"format": "comfyui"})]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        from diffusers import Krea2Pipeline

        from dpipe.models.sync_free import sizes

        image, t, text, text_mask, grid = inputs
        h, w = sizes(grid)
        ids = Krea2Pipeline.prepare_position_ids(text.shape[1], h, w, image.device)
        return denoiser(hidden_states=image, encoder_hidden_states=text, timestep=t,
                        position_ids=ids, encoder_attention_mask=text_mask.bool(),
                        return_dict=False)[0]

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        n, valid = shapes["text"][0], shapes["valid"]
        mask = torch.zeros(n)
        mask[:valid] = 1.0
        return torch.randn(shapes["latents"]), {"text": torch.randn(shapes["text"]),
                                                "text_mask": mask}

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        """6 (full) or 4 (LoRA) x parameters x joint tokens, plus the blocks' attention. The
        text fusion's parameters are counted over the joint tokens too: an overcount of its
        share (it runs over text only, its layerwise blocks over text x tapped layers)."""
        image, _t, text = inputs[:3]
        return joint_attention_train_flops(denoiser, image.shape[0],
                                           image.shape[1] + text.shape[1], full)
