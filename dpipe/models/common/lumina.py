"""What the families of Lumina-Image 2.0's transformer design (Lumina 2, OmniGen2, and Z-Image,
whose own transformer has the same refiners and objective) share above their layers
(`lumina_layers`): the LoRA targets, the objective, the inputs, stage balancing, the ComfyUI LoRA
file, the transformer's own forward and a benchmark sample (`LuminaFamily`)."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from dpipe.diffusion.flow_matching import data_velocity
from dpipe.diffusion.loss import weighted_labels
from dpipe.models.comfyui import comfy_lora_tensors
from dpipe.models.common.shapes import round_up
from dpipe.models.common.lumina_layers import lumina_inputs
from dpipe.models.family import DiffusersFamily
from dpipe.models.lora_files import LoraFormat
from dpipe.models.refined_joint import NOMINAL_IMAGE_TOKENS, layer_forward_flops
from dpipe.models.spec import NoisedBatch, PipelineLayer

# Every Linear of every block (main layers and both refiners): attention, the SwiGLU MLP and the
# adaLN modulation (norm1.linear; the context refiner has none).
_BLOCK_LINEARS = [r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
                  r"feed_forward\.linear_1", r"feed_forward\.linear_2", r"feed_forward\.linear_3",
                  r"norm1\.linear"]
LORA_TARGETS = (r"(?:layers|noise_refiner|context_refiner)\.\d+\.(?:" + "|".join(_BLOCK_LINEARS)
                + ")")

# Weights that see one token per sample (the timestep embedder, the modulations of the blocks
# and of the head's norm), and the embedder's that see the caption's (layer_costs).
PER_SAMPLE_WEIGHTS = ("timestep_embedder", "norm1.linear", "norm_out.linear_1")
TEXT_WEIGHTS = ("caption_embedder",)
COMFY_LORA = "comfyui_lora.safetensors"


class LuminaFamily(DiffusersFamily):
    lora_modules = LORA_TARGETS
    # The layers: the embedding, the caption's and the image's refiner blocks, the join, every
    # main block, the head.
    block_count_keys = ("num_refiner_layers", "num_refiner_layers", "num_layers")
    edge_layers = 3
    # layer_costs: the weights that see one token per sample and those that see the caption's,
    # by module name; the multiple the transformer pads the caption to (Z-Image's 32).
    per_sample_weights: ClassVar[tuple[str, ...]] = PER_SAMPLE_WEIGHTS
    text_weights: ClassVar[tuple[str, ...]] = TEXT_WEIGHTS
    text_token_multiple: ClassVar[int] = 1
    # The ComfyUI LoRA: `comfy_lora_pairs(diffusers-named weights, alpha)` -> {ComfyUI module:
    # (A, B, alpha)}; None where the family writes its own (`lora_formats`).
    comfy_lora_pairs: ClassVar[Callable | None] = None
    # The family's benchmark samples' shapes by size: "latents", "cap", "text_tokens".
    sample_shapes: ClassVar[dict[str, dict[str, Any]]]
    # The transformer predicts x0 - noise (Lumina 2's pipeline steps with -output; OmniGen2's
    # Euler step adds (t_next - t) * output, t rising).
    flow_target = data_velocity

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """Forward FLOPs per layer at a 1024x1024 image and the longest caption
        (`dpipe.models.refined_joint`): the caption refiners run a block's weights over the
        caption alone, the timestep embedder and the modulations once per sample."""
        return layer_forward_flops(layers, NOMINAL_IMAGE_TOKENS,
                                   round_up(self.cfg.max_text_tokens, self.text_token_multiple),
                                   per_sample=self.per_sample_weights,
                                   text_weights=self.text_weights)

    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        pairs = type(self).comfy_lora_pairs  # the function itself, not bound to self
        if pairs is None:
            return super().lora_formats(weights, metadata)
        return [LoraFormat(COMFY_LORA, lambda: comfy_lora_tensors(
            pairs(weights, metadata["lora_alpha"])), {"format": "pt"})]

    def make_inputs(self, batch: NoisedBatch):
        return lumina_inputs(batch), weighted_labels(batch)

    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, t_model, cap, cap_len, _cap_mask = inputs
        mask = torch.arange(cap.shape[1])[None, :] < cap_len[:, None]
        return denoiser(latents, t_model, cap, mask, return_dict=False)[0]

    def random_sample(self, size: str):
        shapes = self.sample_shapes[size]
        mask = torch.zeros(shapes["cap"][0])
        mask[:shapes["text_tokens"]] = 1.0
        return torch.randn(shapes["latents"]), {"cap": torch.randn(shapes["cap"]),
                                                "cap_mask": mask}
