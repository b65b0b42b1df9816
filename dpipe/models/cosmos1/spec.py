"""Cosmos 1.0 Diffusion Text2World (7B / 14B): CosmosTransformer3DModel with a learnable absolute
position embedding + the Cosmos CV8x8x8 VAE (AutoencoderKLCosmos) + T5-11B's encoder, the EDM
formulation. A variant of Cosmos-Predict2 (the same transformer class and layers,
dpipe.models.common.cosmos_layers, with the position embedding added), trained and sampled
otherwise.

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
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.edm import Preconditioning, noisy_input_and_target, sigma_of_t
from dpipe.diffusion.loss import video_loss, weighted_labels
from dpipe.errors import DataError, ModelLoadError
from dpipe.models.common.cosmos import CosmosFamily
from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision
from dpipe.models.cosmos1.latents import FPS, latent_statistics
from dpipe.models.cosmos1.layers import cosmos1_layers
from dpipe.models.cosmos1.original import from_original, lora_to_comfyui, original_state_dict
from dpipe.models.cosmos1.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.diffusers_folder import read_json
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.spec import NoisedBatch, attention_train_flops, model_params
from dpipe.models.sync_free import carrier, sizes

COMFYUI_LORA = "cosmos1_lora_comfyui.safetensors"
PIPELINE = "CosmosTextToWorldPipeline"
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


class Cosmos1Spec(CosmosFamily):
    family = "cosmos1"
    title, example = "Cosmos 1.0 Text2World", "nvidia/Cosmos-1.0-Diffusion-7B-Text2World"
    pipeline_class, vae_class = PIPELINE, "AutoencoderKLCosmos"
    tiny_writer = "dpipe.models.cosmos1.tiny:make_tiny_cosmos1"
    layers = cosmos1_layers  # the same LoRA targets as Cosmos-Predict2's
    error_loss = video_loss  # mask weights broadcast over the frames too
    sampler = "dpipe.models.cosmos1.sampling:Cosmos1Sampling"
    single_file_suffixes = (".pt", ".safetensors")  # NVIDIA's model.pt / ComfyUI's files
    gguf_architectures = ("cosmos",)
    from_single_file, to_original = from_original, original_state_dict

    def read_configs(self) -> None:
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
        return self.part_config("vae")

    @property
    def image_notes(self) -> dict[str, Any]:
        return {"sigma_data": self.sigma_data, "latent": "encoder output"}

    @property
    def pixel_multiple(self) -> int:
        return self._vae.get("spatial_compression_ratio", 8) * 2  # x the 2x2 patches

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

    # ---- training ----------------------------------------------------------------------------
    def noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
        """(c_in x_sigma, (x0 - c_skip x_sigma) / c_out) at sigma = t / (1 - t): EDM."""
        return noisy_input_and_target(x0, noise, sigma_of_t(t), self.sigma_data)

    def make_inputs(self, batch: NoisedBatch):
        latents = batch.latents
        _, _, frames, height, width = latents.shape
        c_noise = Preconditioning(sigma_of_t(batch.timesteps), self.sigma_data).c_noise
        grid = carrier(frames, height // 2, width // 2, FPS)
        inputs = (batch.noisy, c_noise.to(latents.dtype), batch.text["t5"], grid)
        return inputs, weighted_labels(batch)

    # ---- benchmarks --------------------------------------------------------------------------
    bench_configs, sample_shapes, random_text = SIZES, SAMPLE_SHAPES, ("t5",)

    def for_benchmark(self, size: str) -> "Cosmos1Spec":
        """Without a folder: the released scheduler's sigma_data and VAE ratios."""
        import copy

        spec = copy.copy(self)
        spec.__dict__.update(sigma_data=SIGMA_DATA, _vae={"spatial_compression_ratio": 8})
        return spec

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
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFYUI_LORA, lambda: lora_to_comfyui(weights, lora_scale(metadata)),
                           {"format": "comfyui"})]

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
