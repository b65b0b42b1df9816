"""Cosmos 1.0 Diffusion Text2World (7B / 14B): CosmosTransformer3DModel with a learnable absolute
position embedding + the Cosmos CV8x8x8 VAE (AutoencoderKLCosmos) + T5-11B's encoder, the EDM
formulation. A variant of Cosmos-Predict2 (the same transformer class; dpipe.models.cosmos_predict2
layers, with the position embedding added), trained and sampled otherwise.

Objective. EDM (dpipe.diffusion.edm), as CosmosTextToWorldPipeline's EDMEulerScheduler
preconditions the transformer: it takes c_in x_sigma at c_noise = log(sigma) / 4, and its output F
gives x0 = c_skip x + c_out F (sigma_data 0.5 from the folder's scheduler config). A trained t in
[0, 1) is sigma = t / (1 - t), so the default logit-normal(0, 1) t is log sigma ~ N(0, 1)
(EDM's P_mean 0, P_std 1; train.timesteps.logit_mean / logit_std move them), clamped to
[0.002, 80]. The label is (x0 - c_skip x) / c_out and the loss the plain mean error against it:
exactly EDM's loss weighted by lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2.
NVIDIA's training added a learned log-variance (uncertainty) weighting on top, whose head the
released checkpoints carry but diffusers drops; dpipe does not train one.

Latents: the VAE's latents (its encoder output; no sampling) normalised as the pipelines do:
(z - latents_mean) / latents_std * sigma_data, with the statistics per channel and latent frame
(16 x 16 values: clips of up to 121 frames). Clips of 8k+1 frames (1, 9, ..., 121); the rotary
embedding assumes 30 fps (the pipeline's default): resample videos with dataset.video_fps=30.
Prompts go through the pipeline's own `encode_prompt` (T5 states zeroed after the prompt, padded
to `max_text_tokens`, 512 as the pipeline uses).

Weights: the diffusers folder (nvidia/Cosmos-1.0-Diffusion-7B-Text2World), or a single-file
transformer in NVIDIA's layout (model.path=<file>.pt or .safetensors: NVIDIA's model.pt, `net.`
names, or ComfyUI's repackaged file without them) with that folder as model.single_file_config.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.edm import Preconditioning, noisy_input_and_target, sigma_of_t
from dpipe.diffusion.loss import video_loss, weighted_labels
from dpipe.errors import DataError, ModelLoadError
from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision
from dpipe.models.cosmos1.layers import Cosmos1Block, cosmos1_layers
from dpipe.models.cosmos1.original import from_original, lora_to_comfyui, original_state_dict
from dpipe.models.cosmos1.sampling import FPS, latent_statistics
from dpipe.models.cosmos1.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.cosmos_predict2.spec import LORA_TARGETS, REQUIRED_PARTS
from dpipe.models.diffusers_folder import check_folder, load_denoiser, read_json
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, LoraFormat, lora_scale, peft_to_diffusers, save_diffusers_lora,
    write_lora_files)
from dpipe.models.single_file import check_single_file, split_path
from dpipe.models.spec import (ModelSpec, NoisedBatch, PipelineLayer, attention_train_flops,
                               denoiser_config, model_params)
from dpipe.models.sync_free import carrier, sizes

COMFYUI_LORA = "cosmos1_lora_comfyui.safetensors"
PIPELINE = "CosmosTextToWorldPipeline"
SINGLE_FILE_SUFFIXES = (".pt", ".safetensors")  # NVIDIA's model.pt / ComfyUI's files
SIGMA_DATA = 0.5  # the released EDMEulerScheduler's (the folder's config is read where there is one)
MAX_LATENT_FRAMES = 16  # the VAE's latent statistics cover 16 latent frames (121 frames)
# What another Cosmos folder's model_index.json names, and what to use for it.
_OTHER_PIPELINES = {
    "Cosmos2TextToImagePipeline": "a Cosmos-Predict2 Text2Image folder: use model=cosmos_predict2",
    "Cosmos2VideoToWorldPipeline": "a Cosmos-Predict2 Video2World folder: use "
                                   "model=cosmos_predict2",
    "CosmosVideoToWorldPipeline": "a Cosmos 1.0 Video2World folder, which dpipe does not train "
                                  "yet (Text2World only)",
}


class _NoSafetyChecker:
    """Stands in for `CosmosSafetyChecker` (cosmos_guardrail) in the pipeline that encodes
    prompts: guardrails check prompts and decoded videos at generation, not text embeddings."""


class Cosmos1Spec(ModelSpec):
    family = "cosmos1"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.path, self.single_file = split_path(cfg, SINGLE_FILE_SUFFIXES)

    def ensure_available(self) -> None:
        if self.cfg.tiny and not self.path.exists():
            from dpipe.models.cosmos1.tiny import make_tiny_cosmos1

            make_tiny_cosmos1(self.path)
        check_folder(self.path, REQUIRED_PARTS, "Cosmos 1.0 Text2World",
                     "nvidia/Cosmos-1.0-Diffusion-7B-Text2World")
        check_single_file(self.single_file)
        index = self.path / "model_index.json"
        pipeline = read_json(index).get("_class_name")
        if pipeline in _OTHER_PIPELINES:
            raise ModelLoadError(f"{index} names {pipeline}: {_OTHER_PIPELINES[pipeline]}")
        if pipeline != PIPELINE:
            raise ModelLoadError(f"{index} names {pipeline!r}, not {PIPELINE}: not a Cosmos 1.0 "
                                 "Text2World folder")
        config = self.path / "transformer" / "config.json"
        if read_json(config).get("extra_pos_embed_type") != "learnable":
            raise ModelLoadError(f"{config} has no learnable position embedding "
                                 "(extra_pos_embed_type): a Cosmos-Predict2 transformer (use "
                                 "model=cosmos_predict2), not Cosmos 1.0")

    @cached_property
    def sigma_data(self) -> float:
        return float(read_json(self.path / "scheduler" / "scheduler_config.json")
                     .get("sigma_data", 0.5))

    @cached_property
    def _vae(self) -> dict[str, Any]:
        return read_json(self.path / "vae" / "config.json")

    @property
    def pixel_multiple(self) -> int:
        return self._vae.get("spatial_compression_ratio", 8) * 2  # x the 2x2 patches

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import AutoencoderKLCosmos, CosmosTextToWorldPipeline
        from transformers import AutoTokenizer, T5EncoderModel

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path / "tokenizer")
            text_encoder = T5EncoderModel.from_pretrained(self.path / "text_encoder", dtype=dtype)
            vae = AutoencoderKLCosmos.from_pretrained(self.path, subfolder="vae", dtype=dtype)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the encoders from {self.path}: {err}") from None
        for module in (text_encoder, vae):
            module.requires_grad_(False).eval().to(device)
        return CosmosTextToWorldPipeline(text_encoder=text_encoder, tokenizer=tokenizer,
                                         transformer=None, vae=vae, scheduler=None,
                                         safety_checker=_NoSafetyChecker())

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        from diffusers import CosmosTransformer3DModel

        return load_denoiser(CosmosTransformer3DModel, self.path, self.single_file, dtype,
                             convert=from_original)

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "image":
            return {"family": self.family, "vae": folder_fingerprint(self.path / "vae"),
                    "latents_mean": self._vae.get("latents_mean"),
                    "latents_std": self._vae.get("latents_std"), "sigma_data": self.sigma_data,
                    "latent": "encoder output"}
        return {"family": self.family, "t5": folder_fingerprint(self.path / "text_encoder"),
                "tokenizer": folder_fingerprint(self.path / "tokenizer"),
                "max_text_tokens": self.cfg.max_text_tokens}

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) or (B, 3, F, H, W) in [-1, 1] -> normalised latents
        (B, 16, F', h, w), F' = (F - 1) / 8 + 1."""
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        frames = pixels.shape[2]
        vae = encoders.vae
        step = vae.config.temporal_compression_ratio
        if frames % step != 1:
            raise DataError(f"the Cosmos VAE of Cosmos 1.0 takes {step}k+1 frames; got a clip of "
                            f"{frames}: use frame buckets of the form {step}k+1 (1, {step + 1}, "
                            f"{2 * step + 1}, ..., 121)")
        if (frames - 1) // step + 1 > MAX_LATENT_FRAMES:
            raise DataError(f"a clip of {frames} frames: Cosmos 1.0's latent statistics cover "
                            f"{MAX_LATENT_FRAMES} latent frames ({(MAX_LATENT_FRAMES - 1) * step + 1}"
                            " frames at most): use shorter frame buckets")
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        stats = latent_statistics(vae.config, latents)
        if stats is None:
            return latents * self.sigma_data
        return (latents - stats[0]) * self.sigma_data / stats[1]

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
        return LORA_TARGETS  # the same module names as Cosmos-Predict2's

    def noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
        """(c_in x_sigma, (x0 - c_skip x_sigma) / c_out) at sigma = t / (1 - t): EDM."""
        return noisy_input_and_target(x0, noise, sigma_of_t(t), self.sigma_data)

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return cosmos1_layers(denoiser)

    def pipeline_layer_count(self) -> int:
        """cosmos1_layers: the embedding, every block, the head."""
        blocks, = denoiser_config(self.path / "transformer", "CosmosTransformer3DModel",
                                  "num_layers")
        return 2 + blocks

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """Time per layer relative to a block: the blocks are identical; the embedding and head
        are a few Linears over the tokens (by parameter count the embedding's timestep MLP and
        position tables would weigh as half a block)."""
        return [1.0 if isinstance(layer, Cosmos1Block) else 0.02 for layer in layers]

    def make_inputs(self, batch: NoisedBatch):
        latents = batch.latents
        _, _, frames, height, width = latents.shape
        c_noise = Preconditioning(sigma_of_t(batch.timesteps), self.sigma_data).c_noise
        grid = carrier(frames, height // 2, width // 2, FPS)
        inputs = (batch.noisy, c_noise.to(latents.dtype), batch.text["t5"], grid)
        return inputs, weighted_labels(batch)

    def loss(self, outputs, labels) -> torch.Tensor:
        return video_loss(self.element_error(outputs, labels[0]), labels)

    # ---- sampling ----------------------------------------------------------------------------
    def sampling(self):
        from dpipe.models.cosmos1.sampling import Cosmos1Sampling

        return Cosmos1Sampling(self)

    # ---- benchmarks --------------------------------------------------------------------------
    bench_configs = SIZES

    def for_benchmark(self, size: str) -> "Cosmos1Spec":
        """Without a folder: the released scheduler's sigma_data and VAE ratios."""
        import copy

        spec = copy.copy(self)
        spec.__dict__.update(sigma_data=SIGMA_DATA, _vae={"spatial_compression_ratio": 8})
        return spec

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        return torch.randn(shapes["latents"]), {"t5": torch.randn(shapes["t5"])}

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        """6 (full) or 4 (LoRA) x parameters x video tokens, plus self-attention over the video
        tokens and cross-attention to the text in every block."""
        latents, _, text, _ = inputs
        c = denoiser.config
        b, _, f, h, w = latents.shape
        tokens = f * (h // 2) * (w // 2)
        width = c.num_attention_heads * c.attention_head_dim
        attention = attention_train_flops(tokens, width) + attention_train_flops(
            tokens, width, keys=text.shape[1])
        return b * ((6 if full else 4) * model_params(denoiser) * tokens
                    + c.num_layers * attention)

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
        from dpipe.models.diffusers_folder import write_transformer_folder

        return write_transformer_folder(shards, out_dir, self.path, self.single_file,
                                        original_state_dict)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        """As CosmosTextToWorldPipeline calls the transformer: a zero padding mask at pixel size,
        fps 30."""
        hidden, c_noise, text, grid = inputs
        fps = sizes(grid)[3]
        spatial = self._vae.get("spatial_compression_ratio", 8)
        padding_mask = hidden.new_zeros(1, 1, hidden.shape[-2] * spatial,
                                        hidden.shape[-1] * spatial)
        with nearest_resize_without_torchvision():
            return denoiser(hidden_states=hidden, timestep=c_noise, encoder_hidden_states=text,
                            fps=fps, padding_mask=padding_mask, return_dict=False)[0]

    def load_denoiser_with_lora(self, lora_dir: Path, weight_name: str | None = None) -> nn.Module:
        """As diffusers users load a LoRA into Cosmos 1.0, whose pipeline has no
        `load_lora_weights`: `pipe.transformer.load_lora_adapter(dir, prefix="transformer")`."""
        transformer = self.load_denoiser(torch.float32)
        transformer.load_lora_adapter(str(lora_dir), prefix="transformer",
                                      weight_name=weight_name or DIFFUSERS_LORA)
        return transformer

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        from diffusers import CosmosTransformer3DModel

        return CosmosTransformer3DModel.from_pretrained(export_dir / "transformer")


