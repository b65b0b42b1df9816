"""What the Cosmos families share above their transformer's layers (`cosmos_layers`): Cosmos-Predict2
and Cosmos 1.0 (`CosmosFamily`: T5 prompts, CosmosTransformer3DModel, a LoRA loaded as diffusers
users load one into it), and, with Anima, what a Cosmos-Predict2 folder is (`CosmosVariant`,
read by `Predict2Folder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from dpipe.errors import ConfigError, ModelLoadError
from dpipe.models.common.clips import EncodesClips
from dpipe.models.common.cosmos_layers import CosmosBlock
from dpipe.models.family import DiffusersFamily, diffusers_class
from dpipe.models.lora_files import DIFFUSERS_LORA

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer",
                  "scheduler")
# Every Linear of the blocks (attention, MLP and the adaLN-LoRA modulations), as diffusion-pipe
# and ComfyUI users train Cosmos LoRAs. Peft regexes over diffusers' module names.
BLOCK_LINEARS = [
    r"attn1\.to_q", r"attn1\.to_k", r"attn1\.to_v", r"attn1\.to_out\.0",
    r"attn2\.to_q", r"attn2\.to_k", r"attn2\.to_v", r"attn2\.to_out\.0",
    r"ff\.net\.0\.proj", r"ff\.net\.2", r"norm[123]\.linear_[12]",
]
LORA_TARGETS = r"transformer_blocks\.\d+\.(?:" + "|".join(BLOCK_LINEARS) + ")"
# The embedding and head are a few Linears over the tokens: by parameter count the embedding's
# timestep and text projections would weigh as half a block.
EDGE_LAYER_COST = 0.02


@dataclass(frozen=True)
class CosmosVariant:
    pipeline: str  # Cosmos2TextToImagePipeline, Cosmos2VideoToWorldPipeline, AnimaModularPipeline
    z_dim: int
    spatial: int
    temporal: int
    patch: tuple[int, int, int]
    video2world: bool  # a condition-mask input channel


def read_variant(config: Callable[[str], dict[str, Any]], pipeline: str) -> CosmosVariant:
    """What a Cosmos-Predict2 transformer with a Wan-layout VAE is; `config(relative path)` reads
    a JSON file of the folder."""
    transformer = config("transformer/config.json")
    vae = config("vae/config.json")
    z_dim = vae.get("z_dim", 16)
    downsample = vae.get("temperal_downsample", [False, True, True])
    return CosmosVariant(
        pipeline=pipeline, z_dim=z_dim, spatial=2 ** len(downsample),
        temporal=2 ** sum(downsample), patch=tuple(transformer.get("patch_size", (1, 2, 2))),
        video2world=transformer.get("in_channels", z_dim) == z_dim + 1)


def first_frame_task(path: Path, variant: CosmosVariant, wanted: bool | None) -> bool:
    """model.i2v as the checkpoint has it: Video2World conditions on its first frame, Text2Image
    takes none; the other choice is refused."""
    if variant.video2world:
        if wanted is False:
            raise ConfigError(f"{path} is a Video2World model, conditioned on its first "
                              "frame: leave model.i2v unset (or true)")
        return True
    if wanted:
        raise ConfigError(f"{path} is a Text2Image model and takes no first frame: "
                          "leave model.i2v unset (or false)")
    return False


class Predict2Folder:
    """A family whose folder holds a Cosmos-Predict2 transformer and a Wan-layout VAE
    (Cosmos-Predict2's, Anima's): its `variant`, its first-frame task (`i2v`) and pixel multiple."""

    # The variant's pipeline: model_index.json's class (Cosmos-Predict2's two pipelines), or,
    # where False, the family's `pipeline_class` (Anima's modular pipeline, of another index).
    pipeline_in_index: ClassVar[bool] = True

    @cached_property
    def variant(self) -> CosmosVariant:
        config = self.folder_config  # DiffusersFamily's: the folder's, or a benchmark size's
        pipeline = (config("model_index.json")["_class_name"] if self.pipeline_in_index
                    else self.pipeline_class)
        return read_variant(config, pipeline)

    @cached_property
    def i2v(self) -> bool:
        return first_frame_task(self.path, self.variant, self.cfg.i2v)

    @property
    def pixel_multiple(self) -> int:
        return self.variant.spatial * self.variant.patch[1]


@torch.no_grad()
def wan_vae_images(vae, latents: torch.Tensor) -> torch.Tensor:
    """As the Cosmos2 pipelines and Anima's decode (sigma_data 1): latents (1, C, F, h, w) *
    latents_std + latents_mean through the Wan-layout VAE: the clip (3, F, H, W), or the image
    (3, H, W) where F is 1."""
    c = vae.config
    shape = (1, c.z_dim, 1, 1, 1)
    mean = torch.tensor(c.latents_mean).view(shape).to(latents.device, latents.dtype)
    std = torch.tensor(c.latents_std).view(shape).to(latents.device, latents.dtype)
    x = latents * std + mean
    video = vae.decode(x.to(vae.device, vae.dtype), return_dict=False)[0][0].float()
    return video[:, 0] if video.shape[1] == 1 else video


class NoSafetyChecker:
    """Stands in for `CosmosSafetyChecker` (cosmos_guardrail) in the pipeline that encodes
    prompts: guardrails check prompts and decoded videos at generation, not text embeddings."""


class PromptsPass:
    """Stands in for `CosmosSafetyChecker` (the cosmos_guardrail package) in the reference runs
    of the pipelines: with latent output they only ask it about the prompt."""

    def to(self, *args, **kwargs):
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True


class CosmosFamily(EncodesClips, DiffusersFamily):
    """A Cosmos pipeline of a T5 encoder, a VAE (`vae_class`) and CosmosTransformer3DModel."""

    vae_class: ClassVar[str]
    denoiser_class = "CosmosTransformer3DModel"
    required_parts = REQUIRED_PARTS
    text_fingerprint = {"t5": "text_encoder", "tokenizer": "tokenizer"}
    vae_config_keys = ("latents_mean", "latents_std")
    lora_modules = LORA_TARGETS
    # Time per layer relative to a block: the blocks are identical.
    block_types, edge_layer_cost = (CosmosBlock,), EDGE_LAYER_COST
    # The Cosmos pipelines have no `load_lora_weights`; their LoRA loader mixin writes the file.
    lora_writer = "diffusers.loaders.lora_pipeline:CosmosLoraLoaderMixin"

    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        # Built from its parts: from_pretrained would build the safety checker, which needs
        # cosmos_guardrail.
        from transformers import AutoTokenizer, T5EncoderModel

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path / "tokenizer")
            text_encoder = T5EncoderModel.from_pretrained(self.path / "text_encoder", dtype=dtype)
            vae = diffusers_class(self.vae_class).from_pretrained(self.path, subfolder="vae",
                                                                  dtype=dtype)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the encoders from {self.path}: {err}") from None
        for module in (text_encoder, vae):
            module.requires_grad_(False).eval().to(device)
        return diffusers_class(self.pipeline_class)(
            text_encoder=text_encoder, tokenizer=tokenizer, transformer=None, vae=vae,
            scheduler=None, safety_checker=NoSafetyChecker())

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = encoders.encode_prompt(prompts, do_classifier_free_guidance=False,
                                           max_sequence_length=self.cfg.max_text_tokens,
                                           device=encoders.text_encoder.device)
        return {"t5": embeds}

    def load_denoiser_with_lora(self, lora_dir: Path, weight_name: str | None = None) -> nn.Module:
        """As diffusers users load a LoRA into a Cosmos transformer, whose pipelines have no
        `load_lora_weights`: `pipe.transformer.load_lora_adapter(dir, prefix="transformer")`."""
        transformer = self.load_denoiser(torch.float32)
        transformer.load_lora_adapter(str(lora_dir), prefix="transformer",
                                      weight_name=weight_name or DIFFUSERS_LORA)
        return transformer
