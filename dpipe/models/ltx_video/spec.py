"""LTX-Video (0.9.x, 2B/13B): LTXVideoTransformer3DModel + AutoencoderKLLTXVideo (128 channels,
32x spatial, 8x temporal, per-channel latent mean/std) + T5-XXL.

Loads the diffusers folder (Lightricks/LTX-Video), or the single-file checkpoint users download
(model.path=ltx-video-2b-v0.9.5.safetensors: its transformer; see original.py) with that folder as
model.single_file_config for the rest. Prompts go through `LTXPipeline.encode_prompt`.
Images train as 1-frame videos; clips need 8k+1 frames. With `model.i2v=true`, clips train
image-to-video as `LTXImageToVideoPipeline` samples: the first latent frame is the clean image
latent with t = 0 on its tokens, and the loss covers the other frames only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.diffusion.loss import weighted_mean
from dpipe.models.attention_mask import has_padding, trim_text_padding
from dpipe.models.comfyui import renamed
from dpipe.models.frame_modes import takes_first
from dpipe.models.common.clips import EncodesClips
from dpipe.models.common.shapes import causal_clips
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.ltx_video.layers import ltx_layers, rope_scale
from dpipe.models.ltx_video.original import from_original, original_state_dict
from dpipe.models.ltx_video.packing import pack
from dpipe.models.spec import NoisedBatch
from dpipe.models.sync_free import carrier, sizes

COMFYUI_LORA = "ltx_video_lora_comfyui.safetensors"
ENCODING_VERSION = 1
# LTXPipeline's default frame rate: it scales the temporal rotary positions (frames / fps). A
# clip trains at its own rate (`NoisedBatch.fps`, after resampling); images, and batches made
# without a dataset, at this one.
FRAME_RATE = 25

# Every Linear of the transformer blocks: self-attention, cross-attention and feed-forward.
LORA_TARGETS = (r"transformer_blocks\.\d+\.(?:attn1\.to_q|attn1\.to_k|attn1\.to_v|attn1\.to_out\.0"
                r"|attn2\.to_q|attn2\.to_k|attn2\.to_v|attn2\.to_out\.0|ff\.net\.0\.proj|ff\.net\.2)")


def ltx_loss(error: torch.Tensor, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The mean of the per-element `error` over the tokens that are denoised. Labels: (target,)
    or (target, weight, trained): `weight` multiplies each element (mask weights, 0 on condition
    tokens), `trained` (B, N, 1) marks the tokens that count, so the mean is over them alone."""
    if len(labels) == 1:
        return weighted_mean(error)
    target, weight, trained = labels
    return (weight.float() * error).sum() / (trained.float().sum() * target.shape[-1]).clamp(min=1)


class LTXVideoSpec(EncodesClips, DiffusersFamily):
    family = "ltx_video"
    title, example = "LTX-Video", "Lightricks/LTX-Video"
    pipeline_class, denoiser_class = "LTXPipeline", "LTXVideoTransformer3DModel"
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer",
                      "scheduler")
    text_fingerprint = {"t5": "text_encoder", "tokenizer": "tokenizer"}
    text_notes = {"encoding": ENCODING_VERSION}
    vae_config_keys = ("scaling_factor",)
    image_notes = {"encoding": ENCODING_VERSION, "latent": "mode"}
    tiny_writer = "dpipe.models.ltx_video.tiny:make_tiny_ltx_video"
    lora_modules = LORA_TARGETS
    error_loss = ltx_loss  # over the denoised tokens only (image-to-video)
    sampler = "dpipe.models.ltx_video.sampling:LTXVideoSampling"
    # The single file users download (original / ComfyUI names), with model.single_file_config.
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    gguf_architectures = ("ltxv",)
    from_single_file = staticmethod(from_original)
    to_original = staticmethod(original_state_dict)
    comfyui_lora = COMFYUI_LORA
    # A diffusers module name -> ComfyUI's, for its LoRA file: ComfyUI's LTX-Video model uses
    # diffusers' names.
    comfyui_module = staticmethod(lambda name: name)
    text_key = "t5"  # the cached prompt tokens the transformer cross-attends to
    latent_scale = (32, 8)  # LTX's VAEs: 32x in space, 8x in time

    def read_configs(self) -> None:
        self.part_config("vae")
        self.part_config("transformer")

    def _ratios(self) -> tuple[int, int]:
        """(spatial, temporal) compression of the VAE, as AutoencoderKLLTXVideo derives them."""
        vae = self.part_config("vae")
        levels = 2 ** sum(vae.get("spatio_temporal_scaling", (True, True, True, False)))
        spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 4) * levels
        temporal = vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * levels
        return spatial, temporal

    @property
    def _patches(self) -> tuple[int, int]:
        t = self.part_config("transformer")
        return t.get("patch_size", 1), t.get("patch_size_t", 1)

    @property
    def pixel_multiple(self) -> int:
        # The VAE's spatial compression (not its level count) times the transformer's patch.
        return self._ratios()[0] * self._patches[0]

    @property
    def temporal_ratio(self) -> int:
        return self._ratios()[1]

    default_fps: float = FRAME_RATE

    def frame_rates(self, batch: NoisedBatch) -> torch.Tensor:
        """Each sample's frame rate in thousandths of a frame per second, carried in a shape
        (`dpipe.models.sync_free`): the clip's, or the family's default."""
        b = batch.latents.shape[0]
        fps = getattr(batch, "fps", None)
        default = torch.full((b,), float(self.default_fps))
        fps = default if fps is None else torch.where(torch.isnan(fps), default, fps.float())
        return carrier(*(fps.double() * 1000).round().long().tolist())

    @property
    def i2v(self) -> bool:
        return bool(getattr(self.cfg, "i2v", None))

    def frame_modes(self) -> dict[str, float]:
        # One checkpoint makes both: text-to-video (LTXPipeline) and, from a first frame,
        # image-to-video (LTXImageToVideoPipeline); model.i2v picks the default.
        return {"none": float(not self.i2v), "first": float(self.i2v)}

    def given_first_frame(self, batch: NoisedBatch) -> torch.Tensor:
        """(B,) bool: the samples whose first latent frame is given (clean, at t = 0)."""
        if batch.frame_mode is None:
            return torch.full((batch.latents.shape[0],), self.i2v)
        return torch.tensor([takes_first(int(m)) for m in batch.frame_mode])

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) or (B, 3, F, H, W) in [-1, 1] -> normalised (B, C, f, h, w) latents."""
        video = causal_clips(pixels, self.temporal_ratio, self.title)
        vae = encoders.vae
        latents = vae.encode(video.to(vae.device, vae.dtype)).latent_dist.mode()
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents)
        return (latents - mean) * vae.config.scaling_factor / std

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask, _, _ = encoders.encode_prompt(
            prompts, do_classifier_free_guidance=False, device=encoders.vae.device,
            max_sequence_length=self.cfg.max_text_tokens)
        return {"t5": embeds, "mask": mask.long()}

    # ---- training ----------------------------------------------------------------------------
    def pipeline_layers(self, denoiser: nn.Module):
        return ltx_layers(denoiser, self._ratios())  # the rotary positions scale by the VAE's

    def make_inputs(self, batch: NoisedBatch):
        p, pt = self._patches
        x0, noisy, t = batch.latents, batch.noisy, batch.timesteps
        b, c, f, h, w = x0.shape
        grid = (f // pt, h // p, w // p)
        frame_tokens, tokens = grid[1] * grid[2], grid[0] * grid[1] * grid[2]
        given = self.given_first_frame(batch) & (grid[0] > 1)
        condition = bool(given.any())
        if condition:  # the first latent frame is the clean image (LTXImageToVideoPipeline)
            noisy = noisy.clone()
            noisy[given, :, :pt] = x0[given, :, :pt]
            clean = torch.zeros(b, tokens)
            clean[given, :frame_tokens] = 1.0
            t_tokens = t[:, None] * (1 - clean)
        else:
            t_tokens = t[:, None]
        # The text cut after the longest prompt (dpipe.models.attention_mask): at one clip per
        # micro-batch the mask is then empty and cross-attention runs unmasked. Exact: diffusers'
        # -10000 bias on a padded key gives it a weight of exactly 0.
        text, text_mask = trim_text_padding(batch.text[self.text_key], batch.text["mask"])
        inputs = (pack(noisy, p, pt), t_tokens, text, text_mask.long(), carrier(*grid),
                  self.frame_rates(batch))
        target = pack(batch.target, p, pt)
        mask_weight = getattr(batch, "loss_weight", None)  # (B, 1, 1, h, w) or None
        if not condition and mask_weight is None:
            return inputs, (target,)
        trained = torch.ones(b, tokens, 1)
        if condition:
            trained[given, :frame_tokens] = 0
        weight = trained.expand_as(target).clone()
        if mask_weight is not None:
            per_pixel = mask_weight.view(b, 1, 1, h, w).expand(b, 1, f, h, w)
            weight = weight * pack(per_pixel, p, pt).repeat(1, 1, c)
        return inputs, (target, weight, trained)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights: dict[str, torch.Tensor],
                     metadata: dict[str, Any]) -> list[LoraFormat]:
        # ComfyUI's names (`comfyui_module`) under `diffusion_model.`.
        return [LoraFormat(self.comfyui_lora,
                           lambda: renamed(weights, lora_scale(metadata), self.comfyui_module),
                           {"format": "comfyui"})]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        packed, t, text, text_mask, grid, rate = inputs
        f, h, w = sizes(grid)
        return denoiser(
            hidden_states=packed, encoder_hidden_states=text, timestep=t * 1000,
            encoder_attention_mask=text_mask if has_padding(text_mask) else None,
            num_frames=f, height=h, width=w,
            rope_interpolation_scale=rope_scale(self._ratios(), rate), return_dict=False)[0]
