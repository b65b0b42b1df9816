"""Cosmos-Predict2 (2B / 14B, Text2Image and Video2World): CosmosTransformer3DModel + the Wan 2.1
VAE (AutoencoderKLWan) + T5-11B's encoder.

Objective. The pipelines run an EDM sampler (sigma from 80 down to 0.002) but hand the transformer
t = sigma / (sigma + 1), the input x_sigma * (1 - t) and read its output F as x0 = (1 - t) x_sigma
- t F. With x_t = (1 - t) x0 + t noise that is x_sigma * (1 - t), and x0 = x_t - t F: F is the
flow-matching velocity noise - x0, at t in [0, 1] as is (not * 1000). So the default flow-matching
objective trains it exactly; the default logit-normal(0, 1) t is Predict2's log-normal sigma
(log sigma ~ N(0, 1)). Latents are the VAE mean normalised as the pipelines do:
(z - latents_mean) / latents_std * sigma_data (1). Prompts go through the pipeline's own
`encode_prompt` (T5 states, zeroed after the prompt, padded to `max_text_tokens`, 512 as the
pipelines use).

Tasks. Text2Image checkpoints train on images (1-frame latents); Video2World checkpoints on clips
of 4k+1 frames (and images): the first latent frame is given clean, with t = sigma_conditioning /
(1 + sigma_conditioning) (sigma 0.0001, the pipeline's) and a condition-mask channel, and left out
of the loss, as Cosmos2VideoToWorldPipeline conditions on an image. A one-frame item has nothing
left to predict there, so it trains unconditioned. The rotary embedding of clips assumes 16 fps
(the pipeline's default): resample videos with dataset.video_fps=16.

Weights: the diffusers folder (nvidia/Cosmos-Predict2-*), or a single-file transformer in NVIDIA's
layout (model.path=<file>.safetensors or .pt, `net.` keys, as NVIDIA and ComfyUI's repackaged
files hold it) with that folder as model.single_file_config for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.loss import weighted_mean
from dpipe.errors import ConfigError, DataError, ModelLoadError
from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision
from dpipe.models.cosmos_predict2.comfyui import from_original, lora_to_comfyui
from dpipe.models.cosmos_predict2.layers import CosmosBlock, cosmos_layers
from dpipe.models.diffusers_folder import check_folder, load_denoiser, read_json
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, lora_scale, LoraFormat, peft_to_diffusers, save_diffusers_lora,
    write_lora_files)
from dpipe.models.single_file import check_single_file, split_path
from dpipe.models.spec import ModelSpec, NoisedBatch, PipelineLayer, denoiser_config
from dpipe.models.sync_free import carrier, sizes

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer",
                  "scheduler")
COMFYUI_LORA = "cosmos_predict2_lora_comfyui.safetensors"
FPS = 16  # Cosmos2VideoToWorldPipeline's default frame rate, which scales the temporal rope
SIGMA_CONDITIONING = 0.0001  # the pipeline's noise level of the given frames
SINGLE_FILE_SUFFIXES = (".safetensors", ".pt")  # ComfyUI's files / NVIDIA's checkpoints

# Every Linear of the blocks (attention, MLP and the adaLN-LoRA modulations), as diffusion-pipe
# and ComfyUI users train Cosmos-Predict2 LoRAs. A peft regex over diffusers' module names.
_BLOCK_LINEARS = [
    r"attn1\.to_q", r"attn1\.to_k", r"attn1\.to_v", r"attn1\.to_out\.0",
    r"attn2\.to_q", r"attn2\.to_k", r"attn2\.to_v", r"attn2\.to_out\.0",
    r"ff\.net\.0\.proj", r"ff\.net\.2", r"norm[123]\.linear_[12]",
]
LORA_TARGETS = r"transformer_blocks\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"


@dataclass(frozen=True)
class CosmosVariant:
    pipeline: str  # Cosmos2TextToImagePipeline or Cosmos2VideoToWorldPipeline
    z_dim: int
    spatial: int
    temporal: int
    patch: tuple[int, int, int]
    video2world: bool  # a condition-mask input channel


class _NoSafetyChecker:
    """Stands in for `CosmosSafetyChecker` (cosmos_guardrail) in the pipeline that encodes
    prompts: guardrails check prompts and decoded videos at generation, not text embeddings."""


class CosmosPredict2Spec(ModelSpec):
    family = "cosmos_predict2"

    def __init__(self, cfg):
        super().__init__(cfg)
        # model.path: the diffusers folder, or a single-file transformer (NVIDIA's names) with
        # model.single_file_config naming the diffusers folder for the rest.
        self.path, self.single_file = split_path(cfg, SINGLE_FILE_SUFFIXES)

    def ensure_available(self) -> None:
        if self.cfg.tiny and not self.path.exists():
            from dpipe.models.cosmos_predict2.tiny import VARIANTS, make_tiny_cosmos_predict2

            variant = self.path.name.removeprefix("tiny-cosmos_predict2_")
            if variant not in VARIANTS:
                raise ConfigError(f"model.path={self.path}: a tiny Cosmos-Predict2 folder is named "
                                  f"tiny-cosmos_predict2_<variant>, variant in {sorted(VARIANTS)}")
            make_tiny_cosmos_predict2(self.path, variant=variant)
        check_folder(self.path, REQUIRED_PARTS, "Cosmos-Predict2",
                     "nvidia/Cosmos-Predict2-2B-Text2Image")
        check_single_file(self.single_file)
        config = self._config("transformer/config.json")
        if config.get("extra_pos_embed_type"):
            raise ModelLoadError(
                f"{self.path / 'transformer' / 'config.json'} sets extra_pos_embed_type="
                f"{config['extra_pos_embed_type']!r} (a learnable position embedding): a Cosmos 1.0 "
                "transformer, not Cosmos-Predict2: use model=cosmos1")
        if config.get("img_context_dim_in"):
            raise ModelLoadError(f"{self.path / 'transformer' / 'config.json'} sets "
                                 "img_context_dim_in: a Cosmos 2.5 transformer, not supported")
        self.i2v  # noqa: B018 - refuses a task the checkpoint cannot do, before training

    def _config(self, name: str) -> dict[str, Any]:
        return read_json(self.path / name)

    @cached_property
    def variant(self) -> CosmosVariant:
        index = self._config("model_index.json")
        transformer = self._config("transformer/config.json")
        vae = self._config("vae/config.json")
        z_dim = vae.get("z_dim", 16)
        downsample = vae.get("temperal_downsample", [False, True, True])
        return CosmosVariant(
            pipeline=index["_class_name"], z_dim=z_dim, spatial=2 ** len(downsample),
            temporal=2 ** sum(downsample), patch=tuple(transformer.get("patch_size", (1, 2, 2))),
            video2world=transformer.get("in_channels", z_dim) == z_dim + 1)

    @cached_property
    def i2v(self) -> bool:
        if self.variant.video2world:
            if self.cfg.i2v is False:
                raise ConfigError(f"{self.path} is a Video2World model, conditioned on its first "
                                  "frame: leave model.i2v unset (or true)")
            return True
        if self.cfg.i2v:
            raise ConfigError(f"{self.path} is a Text2Image model and takes no first frame: "
                              "leave model.i2v unset (or false)")
        return False

    @property
    def pixel_multiple(self) -> int:
        return self.variant.spatial * self.variant.patch[1]

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import AutoencoderKLWan, Cosmos2TextToImagePipeline
        from transformers import AutoTokenizer, T5EncoderModel

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path / "tokenizer")
            text_encoder = T5EncoderModel.from_pretrained(self.path / "text_encoder", dtype=dtype)
            vae = AutoencoderKLWan.from_pretrained(self.path, subfolder="vae", dtype=dtype)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the encoders from {self.path}: {err}") from None
        for module in (text_encoder, vae):
            module.requires_grad_(False).eval().to(device)
        # Both Cosmos2 pipelines encode prompts with the same code.
        return Cosmos2TextToImagePipeline(text_encoder=text_encoder, tokenizer=tokenizer,
                                          transformer=None, vae=vae, scheduler=None,
                                          safety_checker=_NoSafetyChecker())

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        from diffusers import CosmosTransformer3DModel

        # A single file: NVIDIA's names; the config from the folder
        return load_denoiser(CosmosTransformer3DModel, self.path, self.single_file, dtype,
                             convert=from_original)

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "image":
            vae = self._config("vae/config.json")
            return {"family": self.family, "vae": folder_fingerprint(self.path / "vae"),
                    "latents_mean": vae.get("latents_mean"), "latents_std": vae.get("latents_std"),
                    "sigma_data": 1.0, "latent": "mode"}
        return {"family": self.family, "t5": folder_fingerprint(self.path / "text_encoder"),
                "tokenizer": folder_fingerprint(self.path / "tokenizer"),
                "max_text_tokens": self.cfg.max_text_tokens}

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) or (B, 3, F, H, W) in [-1, 1] -> normalised latents
        (B, 16, F', h, w)."""
        v = self.variant
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        frames = pixels.shape[2]
        if frames > 1 and not v.video2world:
            raise DataError(f"{self.path} is Cosmos-Predict2 Text2Image, an image model: it takes "
                            f"no {frames}-frame clips (use a Video2World checkpoint for videos)")
        if frames % v.temporal != 1:
            raise DataError(f"the Wan VAE of Cosmos-Predict2 takes 4k+1 frames; got a clip of "
                            f"{frames}: use frame buckets of the form 4k+1 (1, 5, 9, ..., 93)")
        vae = encoders.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
        return (latents - mean) / std  # * sigma_data, which is 1

    def encode_videos(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        """The data pipeline's hook for video models: (B, 3, F, H, W) clips, images as F = 1."""
        return self.encode_images(encoders, pixels)

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = encoders.encode_prompt(prompts, do_classifier_free_guidance=False,
                                           max_sequence_length=self.cfg.max_text_tokens,
                                           device=encoders.text_encoder.device)
        return {"t5": embeds}

    # ---- training ----------------------------------------------------------------------------
    def lora_targets(self) -> str:
        return LORA_TARGETS

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return cosmos_layers(denoiser)

    def pipeline_layer_count(self) -> int:
        """cosmos_layers: the embedding, every block, the head."""
        blocks, = denoiser_config(
            self.path / "transformer", "CosmosTransformer3DModel", "num_layers")
        return 2 + blocks

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """Time per layer relative to a block: the blocks are identical, and the embedding and
        head are a few Linears over the tokens (parameter counts would weigh the embedding's large
        timestep and text projections as half a block)."""
        return [1.0 if isinstance(layer, CosmosBlock) else 0.02 for layer in layers]

    def make_inputs(self, batch: NoisedBatch):
        latents, hidden, target = batch.latents, batch.noisy, batch.target
        t = batch.timesteps.to(latents.dtype)
        b, _, frames, height, width = latents.shape
        _, p_h, p_w = self.variant.patch
        grid = carrier(frames, height // p_h, width // p_w, FPS if self.variant.video2world else 0)
        weight = getattr(batch, "loss_weight", None)  # masks, (B, 1, 1, h, w), or None
        if self.variant.video2world:
            condition = torch.zeros_like(latents[:, :1])
            if frames > 1:  # the first latent frame is given, clean, at t ~ 0
                hidden = hidden.clone()
                hidden[:, :, 0] = latents[:, :, 0]
                condition[:, :, 0] = 1
                sigma = torch.tensor(SIGMA_CONDITIONING, dtype=torch.float32)
                t = t[:, None].repeat(1, frames)
                t[:, 0] = (sigma / (sigma + 1)).to(t.dtype)
                # The mean over the predicted frames only: 0 on the first, F / (F - 1) on others.
                given = torch.full((1, 1, frames, 1, 1), frames / (frames - 1), dtype=target.dtype)
                given[:, :, 0] = 0
                weight = given if weight is None else weight * given
            hidden = torch.cat([hidden, condition], dim=1)
        inputs = (hidden, t, batch.text["t5"], grid)
        return inputs, (target,) if weight is None else (target, weight)

    def loss(self, outputs, labels) -> torch.Tensor:
        # labels: (target,) or (target, weight) with weights broadcast over the elements (masks, given frames)
        return weighted_mean(self.element_error(outputs, labels[0]), *labels[1:])

    # ---- sampling ----------------------------------------------------------------------------
    def sampling(self):
        from dpipe.models.cosmos_predict2.sampling import CosmosPredict2Sampling

        return CosmosPredict2Sampling(self)

    # ---- export ------------------------------------------------------------------------------
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        from diffusers.loaders.lora_pipeline import CosmosLoraLoaderMixin

        weights = peft_to_diffusers(state_dict)
        return write_lora_files(
            out_dir, lambda: save_diffusers_lora(CosmosLoraLoaderMixin, weights, metadata, out_dir),
            [LoraFormat(COMFYUI_LORA, lambda: lora_to_comfyui(weights, lora_scale(metadata)),
                        {"format": "comfyui"})])

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        from dpipe.models.cosmos_predict2.comfyui import original_state_dict
        from dpipe.models.diffusers_folder import write_transformer_folder

        return write_transformer_folder(shards, out_dir, self.path, self.single_file,
                                        lambda w: original_state_dict(w, prefix=""))

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        """As the Cosmos2 pipelines call the transformer: a zero padding mask at pixel size, the
        condition mask and (B, 1, F, 1, 1) timesteps for Video2World, fps for clips."""
        hidden, t, text, grid = inputs
        frames, _, _, fps = sizes(grid)
        z = self.variant.z_dim
        kwargs = {}
        if self.variant.video2world:
            kwargs["condition_mask"] = hidden[:, z:]
            t = (t[:, None].expand(-1, frames) if t.ndim == 1 else t)[:, None, :, None, None]
        spatial = self.variant.spatial
        padding_mask = hidden.new_zeros(1, 1, hidden.shape[-2] * spatial,
                                        hidden.shape[-1] * spatial)
        with nearest_resize_without_torchvision():
            return denoiser(hidden_states=hidden[:, :z], timestep=t, encoder_hidden_states=text,
                            fps=fps or None, padding_mask=padding_mask, return_dict=False,
                            **kwargs)[0]

    def load_denoiser_with_lora(self, lora_dir: Path, weight_name: str | None = None) -> nn.Module:
        """As diffusers users load a LoRA into Cosmos-Predict2, whose Cosmos2 pipelines have no
        `load_lora_weights`: `pipe.transformer.load_lora_adapter(dir, prefix="transformer")`."""
        transformer = self.load_denoiser(torch.float32)
        transformer.load_lora_adapter(str(lora_dir), prefix="transformer",
                                      weight_name=weight_name or DIFFUSERS_LORA)
        return transformer

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        from diffusers import CosmosTransformer3DModel

        return CosmosTransformer3DModel.from_pretrained(export_dir / "transformer")

