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

import torch
from torch import nn

from dpipe.errors import DataError, ModelLoadError
from dpipe.models.common.cosmos import CosmosFamily, Predict2Folder
from dpipe.models.common.cosmos_layers import cosmos_layers
from dpipe.models.common.cosmos_names import file_state_dict, from_original, lora_to_comfyui
from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision
from dpipe.models.diffusers_folder import wan_vae_latents
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.spec import NoisedBatch
from dpipe.models.sync_free import carrier, sizes

COMFYUI_LORA = "cosmos_predict2_lora_comfyui.safetensors"
FPS = 16  # Cosmos2VideoToWorldPipeline's default frame rate, which scales the temporal rope
SIGMA_CONDITIONING = 0.0001  # the pipeline's noise level of the given frames


class CosmosPredict2Spec(Predict2Folder, CosmosFamily):
    family = "cosmos_predict2"
    title, example = "Cosmos-Predict2", "nvidia/Cosmos-Predict2-2B-Text2Image"
    # Both Cosmos2 pipelines encode prompts with the same code.
    pipeline_class, vae_class = "Cosmos2TextToImagePipeline", "AutoencoderKLWan"
    image_notes = {"sigma_data": 1.0, "latent": "mode"}
    # The folder's name picks the variant: tiny-cosmos_predict2_<variant>.
    tiny_writer = "dpipe.models.cosmos_predict2.tiny:make_named_tiny_cosmos_predict2"
    layers = cosmos_layers
    sampler = "dpipe.models.cosmos_predict2.sampling:CosmosPredict2Sampling"
    single_file_suffixes = (".safetensors", ".pt")  # ComfyUI's files / NVIDIA's checkpoints
    gguf_architectures = ("cosmos",)
    from_single_file, to_original = from_original, file_state_dict

    def read_configs(self) -> None:
        config = self.part_config("transformer")
        if config.get("extra_pos_embed_type"):
            raise ModelLoadError(
                f"{self.path / 'transformer' / 'config.json'} sets extra_pos_embed_type="
                f"{config['extra_pos_embed_type']!r} (a learnable position embedding): a Cosmos 1.0 "
                "transformer, not Cosmos-Predict2: use model=cosmos1")
        if config.get("img_context_dim_in"):
            raise ModelLoadError(f"{self.path / 'transformer' / 'config.json'} sets "
                                 "img_context_dim_in: a Cosmos 2.5 transformer, not supported")
        self.i2v  # noqa: B018 - refuses a task the checkpoint cannot do, before training

    # ---- caching -----------------------------------------------------------------------------
    def encode_images(self, encoders, pixels: torch.Tensor) -> torch.Tensor:
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
        return wan_vae_latents(encoders.vae, pixels)

    # ---- training ----------------------------------------------------------------------------
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

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFYUI_LORA, lambda: lora_to_comfyui(weights, lora_scale(metadata)),
                           {"format": "comfyui"})]

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
