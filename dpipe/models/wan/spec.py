"""Wan 2.1 and 2.2 (text-to-video, image-to-video, TI2V-5B, the two A14B experts):
WanTransformer3DModel + AutoencoderKLWan + UMT5 (+ a CLIP image encoder for 2.1 i2v).

One family for every Wan checkpoint in diffusers format; what a folder is comes from its configs:
- Wan 2.1 t2v, Wan 2.2 T2V-A14B: the latents alone.
- i2v (Wan 2.1 I2V, Wan 2.2 I2V-A14B): the transformer takes 2z+4 channels, the noisy latents,
  4 mask channels (1 on the first latent frame) and the latents of [first frame, zeros...]; Wan
  2.1 i2v also attends to 257 CLIP tokens of the first frame (`image_dim` in its config).
- Wan 2.2 TI2V-5B (`expand_timesteps`): one timestep per token; with `model.i2v=true` the first
  latent frame is the clean frame at t = 0 and the loss leaves it out (videos only: a one-frame
  item has nothing left to predict, so it trains text-to-image).
- Wan 2.2 A14B (`boundary_ratio`, a `transformer_2`): two experts, the high-noise `transformer`
  for t >= boundary and the low-noise `transformer_2` below. Each is trained as its own model:
  `model.min_t`/`max_t` pick the expert (the range must lie on one side of the boundary) and the
  sampled t is mapped into the range (`ModelSpec.train_timesteps`), where latents are noised
  and where the transformer gets its timestep.

Objective: flow matching, x_t = (1 - t) x0 + t noise, the transformer predicts noise - x0 and is
given t * 1000 (the diffusers pipelines pass the scheduler's timesteps, sigma * 1000). Latents
are the VAE mean, normalised as the pipelines do: (z - latents_mean) / latents_std. Prompts are
embedded by `WanPipeline.encode_prompt`: UMT5 states, zeroed after the prompt, padded to
`max_text_tokens` (512 as Wan trains; the i2v attention needs exactly 512).

Video latents are (B, C, F, h, w), F = (frames - 1) / 4 + 1: clips need 4k+1 frames; an image is
a 1-frame video.

Cached latents of i2v checkpoints carry their conditioning after the z latent channels (the
cache holds one tensor per item): the latents of [first frame, zeros...] (z channels) and, for
Wan 2.1 i2v, the CLIP image tokens flattened and zero-padded into as many more channels as they
fill (`_pack` / `_unpack`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.flow_matching import noisy_latents, velocity_target
from dpipe.errors import ConfigError, DataError, ModelLoadError
from dpipe.models import tiny_stamp
from dpipe.models.common.clips import EncodesClips
from dpipe.models.diffusers_folder import check_folder
from dpipe.models.family import DiffusersFamily, imported
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.frame_modes import FIRST, FRAME_MODES
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.single_file import check_single_file
from dpipe.models.spec import NoisedBatch, attention_train_flops, model_params
from dpipe.models.wan.comfyui import from_original, lora_to_comfyui, original_state_dict
from dpipe.models.wan.layers import WanBlock, wan_layers
from dpipe.models.wan.sizes import SAMPLE_SHAPES, SIZES, T2V_FOLDER
from dpipe.models.wan.frames import condition_mask, condition_video, image_embedder_input
from dpipe.models.wan.variant import WanVariant, pack_tokens, read_variant, unpack_tokens

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer",
                  "scheduler")
COMFYUI_LORA = "wan_lora_comfyui.safetensors"
# Bump when the layout of cached latents changes (the conditioning channels), so old entries are
# never read as new ones.
_CACHE_LAYOUT = 1

# What the community trains for Wan LoRAs: every Linear of the blocks (self- and cross-attention
# incl. the i2v image projections, the MLP), none outside them. A peft regex over diffusers names.
_BLOCK_LINEARS = [
    r"attn1\.to_q", r"attn1\.to_k", r"attn1\.to_v", r"attn1\.to_out\.0",
    r"attn2\.to_q", r"attn2\.to_k", r"attn2\.to_v", r"attn2\.to_out\.0",
    r"attn2\.add_k_proj", r"attn2\.add_v_proj", r"ffn\.net\.0\.proj", r"ffn\.net\.2",
]
LORA_TARGETS = r"blocks\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"


@dataclass
class WanEncoders:
    text: Any  # WanPipeline holding the tokenizer, UMT5 and the VAE
    image: Any | None  # WanImageToVideoPipeline with the CLIP image encoder (Wan 2.1 i2v)


class WanSpec(EncodesClips, DiffusersFamily):
    family = "wan"
    supports_timestep_range = True
    title, example = "Wan", "Wan-AI/Wan2.1-T2V-14B-Diffusers"
    pipeline_class, denoiser_class = "WanPipeline", "WanTransformer3DModel"
    required_parts = REQUIRED_PARTS
    text_fingerprint = {"umt5": "text_encoder", "tokenizer": "tokenizer"}
    vae_config_keys = ("latents_mean", "latents_std")
    # The folder's name picks the variant: .../tiny-<variant>.
    tiny_writer = "dpipe.models.wan.tiny:make_named_tiny_wan"
    lora_modules = LORA_TARGETS
    layers = wan_layers
    # The blocks are identical, and the embedding and head are a few Linears over the tokens
    # (parameter counts would weigh the embedding's large timestep and text projections as half
    # a block).
    block_types, edge_layer_cost = (WanBlock,), 0.02
    sampler = "dpipe.models.wan.sampling:WanSampling"
    # A single-file transformer (the original / ComfyUI layout, e.g.
    # wan2.1_t2v_14B_bf16.safetensors) trains with everything else from a diffusers folder.
    single_file_suffixes = (".safetensors", ".sft")
    gguf_architectures = ("wan",)
    from_single_file, to_original = from_original, original_state_dict

    @property
    def root_key(self) -> str:
        """The setting that names the diffusers folder, for messages."""
        return "model.single_file_config" if self.single_file else "model.path"

    def ensure_available(self) -> None:
        # The folder's checks name the setting that gives it (model.single_file_config for a
        # single file), and the tiny variant and the trained expert are checked too.
        check_single_file(self.single_file)
        if self.cfg.tiny and tiny_stamp.needs_writing(self.path):
            imported(self.tiny_writer)(self.path, self.root_key)
        check_folder(self.path, REQUIRED_PARTS, self.title, self.example, key=self.root_key)
        if self.variant.clip_tokens:  # Wan 2.1 i2v reads the image with CLIP too
            check_folder(self.path, ("image_encoder", "image_processor"), "Wan 2.1 i2v",
                         "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", key=self.root_key)
        if not (self.path / self.expert).is_dir():
            raise ModelLoadError(f"{self.root_key}={self.path} has no {self.expert}/ folder")
        if self.variant.clip_tokens and self.cfg.max_text_tokens != 512:
            raise ConfigError(
                f"model.max_text_tokens={self.cfg.max_text_tokens}: Wan 2.1 i2v's attention splits "
                "its context at 512 text tokens; set model.max_text_tokens=512")
        self.i2v  # noqa: B018 - refuses a task the checkpoint cannot do, before training

    # ---- what the folder is ------------------------------------------------------------------
    @cached_property
    def variant(self) -> WanVariant:
        return read_variant(self.folder_config)

    @cached_property
    def expert(self) -> str:
        """The transformer subfolder this run trains: `transformer`, or for a two-expert model
        the one whose t range holds [min_t, max_t]."""
        boundary = self.variant.boundary
        if boundary is None:
            return "transformer"
        lo, hi = self.cfg.min_t, self.cfg.max_t
        if lo >= boundary:
            return "transformer"  # high noise
        if hi <= boundary:
            return "transformer_2"  # low noise
        raise ConfigError(
            f"model.min_t={lo}, model.max_t={hi} spans both experts of this Wan 2.2 model "
            f"(boundary t={boundary}): train the high-noise expert with model.min_t={boundary} "
            f"(transformer/) or the low-noise one with model.max_t={boundary} (transformer_2/)")

    @cached_property
    def i2v(self) -> bool:
        v, wanted = self.variant, self.cfg.i2v
        if v.concat_condition:  # image-to-video checkpoints need their image
            if wanted is False:
                raise ConfigError(f"{self.path} is an image-to-video Wan model: leave model.i2v "
                                  "unset (or true)")
            return True
        if v.expand_timesteps:  # TI2V-5B does both
            return bool(wanted)
        if wanted:
            raise ConfigError(f"{self.path} is a text-to-video Wan model and takes no first "
                              "frame: leave model.i2v unset (or false)")
        return False

    def frame_modes(self) -> dict[str, float]:
        v = self.variant
        if v.condition_modes:  # the first mode is the checkpoint's own task
            return {m: float(i == 0) for i, m in enumerate(v.condition_modes)}
        if v.expand_timesteps:  # TI2V-5B does both; model.i2v picks the default
            return {"none": float(not self.i2v), "first": float(self.i2v)}
        return {"none": 1.0}

    @property
    def denoiser_folder(self) -> str:
        return self.expert

    @property
    def pixel_multiple(self) -> int:
        return self.variant.spatial * self.variant.patch[1]

    # The cache keys: what shapes the latents besides the VAE (the conditioning channels) and
    # the prompts (Wan's prompt cleaning uses ftfy when installed).
    @property
    def image_notes(self) -> dict[str, Any]:
        notes = {"layout": _CACHE_LAYOUT, "latent": "mode",
                 "condition": self.variant.concat_condition}
        if self.variant.condition_modes not in ((), ("first",)):  # more than the first frame
            notes["frames"] = list(self.variant.condition_modes)
        if self.variant.clip_tokens:
            notes["clip"] = [folder_fingerprint(self.path / p)
                             for p in ("image_encoder", "image_processor")]
        return notes

    @property
    def text_notes(self) -> dict[str, Any]:
        ftfy = importlib.util.find_spec("ftfy")
        return {"ftfy": _version("ftfy") if ftfy else None}

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> WanEncoders:
        from diffusers import AutoencoderKLWan, WanPipeline
        from transformers import AutoTokenizer, UMT5EncoderModel

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path / "tokenizer")
            text_encoder = UMT5EncoderModel.from_pretrained(self.path / "text_encoder", dtype=dtype)
            vae = AutoencoderKLWan.from_pretrained(self.path, subfolder="vae", dtype=dtype)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the encoders from {self.path}: {err}") from None
        for module in (text_encoder, vae):
            module.requires_grad_(False).eval().to(device)
        # WanPipeline's encode_prompt (WanImageToVideoPipeline's needs ftfy installed).
        text = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=None)
        image = None
        if self.variant.clip_tokens:
            image = self.load_image_encoder(device, dtype, tokenizer=tokenizer,
                                            text_encoder=text_encoder, vae=vae)
        return WanEncoders(text=text, image=image)

    def load_image_encoder(self, device: torch.device, dtype: torch.dtype, **parts):
        """Wan 2.1 i2v's CLIP image encoder in a WanImageToVideoPipeline (its `encode_image`),
        with the other `parts` given (none: the image encoder alone)."""
        import transformers
        from diffusers import WanImageToVideoPipeline

        # The classes model_index.json names (CLIPVisionModelWithProjection in the repos).
        index = self.folder_config("model_index.json")
        try:
            processor = getattr(transformers, index["image_processor"][1]).from_pretrained(
                self.path / "image_processor")
            encoder = getattr(transformers, index["image_encoder"][1]).from_pretrained(
                self.path / "image_encoder", dtype=dtype)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the image encoder of {self.path}: {err}") from None
        encoder.requires_grad_(False).eval().to(device)
        parts = {"tokenizer": None, "text_encoder": None, "vae": None, **parts}
        return WanImageToVideoPipeline(scheduler=None, image_processor=processor,
                                       image_encoder=encoder, **parts)

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, encoders: WanEncoders, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) (an image: one frame) or (B, 3, F, H, W) in [-1, 1] -> normalised
        latents (B, z, F', h, w), followed by the conditioning channels of i2v checkpoints."""
        v = self.variant
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        frames = pixels.shape[2]
        if frames % v.temporal != 1:
            raise DataError(
                f"Wan's VAE takes 4k+1 frames; got a clip of {frames}: use frame buckets of the "
                "form 4k+1 (1, 5, 9, ..., 81) in dataset.frame_buckets")
        vae = encoders.text.vae
        latents = self._vae_encode(vae, pixels)
        parts = [latents]
        for mode in v.condition_modes:
            if frames == 1:  # the condition video is the image itself
                parts.append(latents)
            else:
                parts.append(self._vae_encode(vae, condition_video(pixels, mode)))
        if v.clip_tokens:  # FLF2V: the first frame's tokens, then the last one's
            shown = [pixels[:, :, 0]] + ([pixels[:, :, -1]] if v.flf2v else [])
            parts.append(pack_tokens(self.clip_tokens(encoders.image, shown), latents.shape))
        return torch.cat([p.to(latents.dtype) for p in parts], dim=1)

    @staticmethod
    def _vae_encode(vae, pixels: torch.Tensor) -> torch.Tensor:
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents)
        return (latents - mean) * inv_std

    def clip_tokens(self, pipe, frames: list[torch.Tensor]) -> torch.Tensor:
        """The CLIP tokens the transformer takes of (B, 3, H, W) frames (the first; FLF2V's first
        and last), (B, tokens, D), as the cache packs them."""
        return torch.cat([self._clip_tokens(pipe, f) for f in frames], dim=1)

    @staticmethod
    def _clip_tokens(pipe, first_frames: torch.Tensor) -> torch.Tensor:
        # As the user's image reaches the image encoder at inference: 8-bit RGB through the
        # pipeline's CLIPImageProcessor, the penultimate hidden states (WanImageToVideoPipeline).
        rgb = ((first_frames.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        images = list(rgb.permute(0, 2, 3, 1).cpu().numpy())
        return pipe.encode_image(images, device=pipe.image_encoder.device).float()

    @torch.no_grad()
    def encode_prompts(self, encoders: WanEncoders, prompts: list[str]) -> dict[str, torch.Tensor]:
        pipe = encoders.text
        embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=self.cfg.max_text_tokens,
                                       device=pipe.text_encoder.device)
        return {"umt5": embeds}

    # ---- training ----------------------------------------------------------------------------
    def noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
        # Only the z latent channels are noised; i2v conditioning channels stay as cached.
        z = self.variant.z_dim
        x, n = x0[:, :z], noise[:, :z]
        return noisy_latents(x, n, self.train_timesteps(t)), velocity_target(x, n)

    def make_inputs(self, batch: NoisedBatch):
        v, z = self.variant, self.variant.z_dim
        latents = batch.latents
        t = self.train_timesteps(batch.timesteps).to(latents.dtype)
        hidden, target = batch.noisy, batch.target
        frames = latents.shape[2]
        # Per-element loss weights: masks from the dataset, (B, 1, 1, h, w), or None.
        weight = getattr(batch, "loss_weight", None)
        if v.concat_condition:
            modes = self._frame_modes(batch)
            hidden = torch.cat([hidden, condition_mask(latents[:, :4], modes),
                                torch.stack([latents[b, v.condition_channels(m)]
                                             for b, m in enumerate(modes)])], dim=1)
        elif v.expand_timesteps and frames > 1 and self._given_first(batch).any():
            # TI2V: a sample given its first frame has it clean at t = 0, left out of the loss.
            given = self._given_first(batch)
            hidden = hidden.clone()
            hidden[given, :, 0] = latents[given, :z, 0]
            t = t[:, None].repeat(1, frames)
            t[given, 0] = 0
            # Their mean over the predicted frames only: 0 on the first, F / (F - 1) on the others.
            rows = torch.ones(len(given), 1, frames, 1, 1, dtype=target.dtype)
            rows[given] = frames / (frames - 1)
            rows[given, :, 0] = 0
            weight = rows if weight is None else weight * rows
        inputs = (hidden, t, batch.text["umt5"])
        if v.clip_tokens:
            inputs += (unpack_tokens(latents[:, v.tokens_start:], v.image_tokens, v.image_dim),)
        return inputs, (target,) if weight is None else (target, weight)

    def _given_first(self, batch: NoisedBatch) -> torch.Tensor:
        """(B,) bool: TI2V samples given their first frame (model.i2v where the batch has no
        modes)."""
        if batch.frame_mode is None:
            return torch.full((len(batch.latents),), self.i2v)
        return batch.frame_mode == FIRST

    def _frame_modes(self, batch: NoisedBatch) -> list[str]:
        """Each sample's frame mode by name; the checkpoint's own where the batch has none."""
        if batch.frame_mode is None:
            return [self.variant.condition_modes[0]] * len(batch.latents)
        return [FRAME_MODES[int(m)] for m in batch.frame_mode]

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFYUI_LORA, lambda: lora_to_comfyui(weights, lora_scale(metadata)),
                           {"format": "comfyui", "expert": self.expert})]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        """As the diffusers pipelines call the transformer (per-token timesteps for TI2V)."""
        latents, t, text, *image = inputs
        timestep = t * 1000
        if self.variant.expand_timesteps:
            _, _, frames, height, width = latents.shape
            _, p_h, p_w = self.variant.patch
            if timestep.ndim == 1:
                timestep = timestep[:, None].expand(-1, frames)
            timestep = timestep.repeat_interleave((height // p_h) * (width // p_w), dim=1)
        image = image_embedder_input(denoiser.condition_embedder, image[0] if image else None)
        return denoiser(hidden_states=latents, timestep=timestep, encoder_hidden_states=text,
                        encoder_hidden_states_image=image, return_dict=False)[0]

    def _pipeline(self, **components):
        import diffusers

        cls = getattr(diffusers, self.variant.pipeline)
        skip = {"text_encoder": None, "tokenizer": None, "vae": None}
        if self.variant.pipeline == "WanImageToVideoPipeline":
            skip.update(image_encoder=None, image_processor=None)
        if self.single_file:  # the trained expert from its file, as the user loads it
            components.setdefault(self.expert, self.load_denoiser(torch.float32))
        return cls.from_pretrained(self.path, **{**skip, **components})

    def load_denoiser_with_lora(self, lora_dir: Path, weight_name: str | None = None) -> nn.Module:
        """The way users load a Wan LoRA: `pipe.load_lora_weights(...)`, with
        `load_into_transformer_2=True` for a LoRA of Wan 2.2's low-noise expert. `weight_name`
        picks the file (e.g. the ComfyUI one, which diffusers converts)."""
        pipe = self._pipeline()
        kwargs = {"weight_name": weight_name} if weight_name else {}
        if self.expert == "transformer_2":
            kwargs["load_into_transformer_2"] = True
        pipe.load_lora_weights(str(lora_dir), **kwargs)
        return getattr(pipe, self.expert)

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs, sample_shapes, random_text = SIZES, SAMPLE_SHAPES, ("umt5",)

    def bench_folder(self, size: str) -> dict[str, dict[str, Any]]:
        # What the model is comes from its folder (`variant`); a size stands for Wan 2.1 T2V.
        return {**T2V_FOLDER, "transformer/config.json": SIZES[size]}

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        hidden, _t, text = inputs[:3]
        b, _, f, h, w = hidden.shape
        c = denoiser.config
        pt, ph, pw = c.patch_size
        tokens = (f // pt) * (h // ph) * (w // pw)
        width = c.num_attention_heads * c.attention_head_dim
        # Self-attention over the video, cross-attention from it to the (padded) text.
        attention = c.num_layers * (attention_train_flops(tokens, width)
                                    + attention_train_flops(tokens, width, text.shape[1]))
        return b * ((6 if full else 4) * model_params(denoiser) * tokens + attention)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
