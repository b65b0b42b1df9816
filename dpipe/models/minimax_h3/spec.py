"""MiniMax H3 (MiniMaxAI/MiniMax-H3): text-to-video with stereo audio, one transformer
(MiniMaxH3Transformer3DModel) over one packed `[text | audio | video]` sequence per sample, the
video VAE AutoencoderKLMiniMaxH3, the audio VAE AutoencoderKLMiniMaxH3Audio and Qwen3-VL's
`hidden_states[50]` as the text; diffusers' MiniMaxH3ModularPipeline (modular only, like Anima).
dpipe trains the `transformer/` partition (t2va, fl2va), LoRA and full.

Objective, in MiniMax H3's convention (MiniMaxH3Scheduler): the transformer is given t = 1 - sigma
(1 is clean, unscaled) and predicts the data-ward velocity x0 - noise; dpipe's t is sigma, so
`noise` returns x0 - noise as the target and `make_inputs` hands the transformer 1 - t.
Latents: the video VAE's mean of ImageNet-normalised pixels, (z - latents_mean) / latents_std;
clips need 17k+5 frames (5k+2 latent frames), an image is one frame (the spatial encoder alone).
Prompts: the prompt's tokens verbatim (no chat template, no special tokens), Qwen3-VL's
hidden_states[50] (MiniMaxH3TextEncoderStep), padded to `model.max_text_tokens` with a mask; the
checkpoint is guidance-distilled, so there is no negative prompt.

Audio: see `layers.py` for why video-only training is not the joint computation t2va runs;
`model.audio=true` trains both streams (`trains_audio`). `model.guidance` s > 1: CFG-augmented
training (the community recipes' way to keep the distilled guidance): each sample also runs
with the unconditional prompt (a single space), without gradient, and the model fits
(cond + (s - 1) uncond) / s to the target.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.flow_matching import data_velocity
from dpipe.diffusion.loss import per_sample_weight, weighted_mean
from dpipe.errors import ConfigError, DataError
from dpipe.models.common.clips import EncodesClips
from dpipe.models.diffusers_folder import load_or_fail, read_json
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.minimax_h3.comfyui import (
    diffusers_state_dict, lora_to_comfyui, original_state_dict)
from dpipe.models.minimax_h3.layers import (
    AUDIO_CHANNELS, MiniMaxH3Block, cfg_augmented, minimax_h3_layers, packed_layout)
from dpipe.models.minimax_h3.processor import load_processor
from dpipe.models.minimax_h3.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.minimax_h3.tiny import INDEX, REPO
from dpipe.models.single_file import export_like_source
from dpipe.models.spec import (
    AudioFormat, NoisedBatch, PipelineLayer, attention_train_flops, denoiser_config,
    model_params, replace_rows)
from dpipe.models.sync_free import carrier, sizes

REQUIRED_PARTS = (INDEX, "transformer", "vae", "audio_vae", "text_encoder", "tokenizer",
                  "processor", "scheduler", "audio_scheduler")
TEXT_LAYER = 50  # MiniMaxH3ModularPipeline.text_encoder_layer
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the pipeline's, ImageNet's
SAMPLE_RATE = 32000
# The release's video VAE as `vae_geometry` reads it (16x in space; 17-frame clips, 5 latent
# frames each), for the benchmark sizes, which have no folder.
RELEASE_VAE = {"spatial_downsample_factors": [2, 2, 2, 2, 1, 1],
               "temporal_downsample_factors": [1, 2, 2, 1, 1, 1], "clip_length": 17}
COMFYUI_LORA = "minimax_h3_lora_comfyui.safetensors"
# The unconditional prompt of CFG-augmented training: a single space, the near-empty probe that
# musubi-tuner's MiniMax H3 guidance loss found to behave as the distillation's uncond (PR #1045).
UNCOND_PROBE = " "

# Every Linear of the blocks: attention, the SwiGLU feed-forward and the AdaLN projection (the
# published H3 LoRAs train all three). A peft regex over diffusers names.
_BLOCK_LINEARS = [r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
                  r"ff\.net\.0\.proj", r"ff\.net\.2", r"adaln_proj\.linear"]
LORA_TARGETS = r"transformer_blocks\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"


def patchify(latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """(B, C, F, h, w) -> (B, rows, C * prod(patch)), as the pipeline packs video rows."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    return patchify_video_latents(latents, patch).reshape(latents.shape[0], -1,
                                                          latents.shape[1] * _prod(patch))


def split_prediction(joined: torch.Tensor, video_shape, audio_shape):
    """The head's joined (B, Nv*Cv + Na*Ca) output -> (video rows, audio rows)."""
    n = int(torch.Size(video_shape[1:]).numel())
    return (joined[:, :n].reshape(video_shape),
            joined[:, n:].reshape(joined.shape[0], *audio_shape[1:]))


def _prod(patch) -> int:
    return int(patch[0] * patch[1] * patch[2])


@torch.no_grad()
def stereo_audio_rows(encoders: Any, waveforms: torch.Tensor) -> torch.Tensor:
    """Stereo waveforms (B, 2, samples) -> (B, 2 * n, C) audio rows, channel-major (the
    left channel's n latents, then the right's), normalised: the layout of the pipeline's
    audio rows, whose decode step inverts it. Each channel is encoded as a mono clip (the
    audio VAE is mono; the pipeline passes the two channels as two batch items), the
    posterior's mean as the pipeline takes it."""
    vae = encoders.audio_vae
    b, channels, samples = waveforms.shape
    if channels != AUDIO_CHANNELS:
        raise DataError(f"MiniMax H3 trains on stereo audio; got {channels} channel(s)")
    mono = waveforms.reshape(b * channels, 1, samples).to(vae.device, vae.dtype)
    latents = vae.encode(mono).latent_dist.mode().float()  # (B * 2, C, n)
    # The VAE pads to a whole hop; the pipeline gives a clip round(seconds * 40) latents.
    latents = latents[..., :max(1, round(samples / vae.hop_length))]
    mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(1, -1, 1)
    std = torch.tensor(vae.config.latents_std, device=latents.device).view(1, -1, 1)
    latents = (latents - mean) / std
    c, n = latents.shape[1:]
    return latents.reshape(b, channels, c, n).permute(0, 1, 3, 2).reshape(b, channels * n, c)


def from_original(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A single file's original names -> diffusers', for `model`'s config."""
    return diffusers_state_dict(state, model.config)


class MiniMaxH3Spec(EncodesClips, DiffusersFamily):
    family = "minimax_h3"
    trains_audio = True
    title, example = "MiniMax H3", REPO
    pipeline_class, denoiser_class = "MiniMaxH3ModularPipeline", "MiniMaxH3Transformer3DModel"
    index_file, required_parts = INDEX, REQUIRED_PARTS
    text_fingerprint = {"qwen3_vl": "text_encoder", "tokenizer": "tokenizer"}
    vae_config_keys = ("latents_mean", "latents_std")
    image_notes = {"latent": "mode", "pixels": [PIXEL_MEAN, PIXEL_STD]}
    flow_target = data_velocity  # x0 = x_t + sigma * v: MiniMaxH3Scheduler's convention
    audio_latents = stereo_audio_rows
    # The audio rows' layout (`encode_audio`) and normalisation.
    audio_config_keys = ("latents_mean", "latents_std")
    audio_notes = {"latent": "mode", "layout": "rows"}
    tiny_writer = "dpipe.models.minimax_h3.tiny:make_tiny_minimax_h3"
    lora_modules = LORA_TARGETS
    # A block is 1; the embedding (projections and the two text-refiner blocks over the
    # prompt's few hundred tokens against the media's thousands) and the head are small.
    block_types, edge_layer_cost = (MiniMaxH3Block,), 0.05
    sampler = "dpipe.models.minimax_h3.sampling:MiniMaxH3Sampling"
    # A single-file transformer (Comfy-Org/MiniMax-H3's diffusion_models/*) trains with the
    # rest from the diffusers folder named by model.single_file_config.
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    from_single_file = from_original
    # Its GGUFs (the same original names): `minimax_h3` as the community repacks name it, and
    # `wan`, which some repacks carry so that ComfyUI-GGUF, whose list lacks minimax_h3, loads
    # them (a Wan file given here fails on its names).
    gguf_architectures = ("minimax_h3", "wan")

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.guidance < 1:
            raise ConfigError(
                f"model.guidance={cfg.guidance}: MiniMax H3 reads it as the CFG-augmented "
                "training scale s (1: plain flow matching; 3-4 keeps the release's distilled "
                "guidance): give a value >= 1")

    @property
    def guided(self) -> bool:
        """CFG-augmented training (model.guidance > 1)."""
        return self.cfg.guidance > 1

    @property
    def text_notes(self) -> dict[str, Any]:
        # The unconditional prompt cached beside each caption, if any.
        return {"layer": TEXT_LAYER, "uncond": UNCOND_PROBE if self.guided else None}

    @cached_property
    def patch(self) -> tuple[int, int, int]:
        return tuple(self.part_config("transformer").get("patch_size", (1, 2, 2)))

    @cached_property
    def vae_geometry(self) -> tuple[int, int, int]:
        """(spatial factor, clip_length, latent frames per chunk) of the video VAE."""
        import math

        vae = self.part_config("vae")
        spatial = math.prod(vae.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1)))
        temporal = math.prod(vae.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))
        clip = vae.get("clip_length", 17)
        return spatial, clip, -(-clip // temporal)

    @property
    def pixel_multiple(self) -> int:
        return self.vae_geometry[0] * self.patch[2]

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        """The text-encoder step's components (Qwen3-VL, its tokenizer and processor), the video
        VAE, and with model.audio the audio VAE; as the pipeline's components namespace."""
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        p = self.path
        tokenizer = load_or_fail(lambda: AutoTokenizer.from_pretrained(p / "tokenizer"),
                                 p / "tokenizer")
        processor = load_or_fail(lambda: load_processor(p / "processor"), p / "processor")
        text_encoder = load_or_fail(lambda: Qwen3VLForConditionalGeneration.from_pretrained(
            p / "text_encoder", dtype=dtype), p / "text_encoder")
        vae = load_or_fail(lambda: AutoencoderKLMiniMaxH3.from_pretrained(
            p, subfolder="vae", dtype=torch.float32), p / "vae")
        modules = [text_encoder, vae]
        audio_vae = None
        if self.cfg.audio:
            audio_vae = load_or_fail(lambda: AutoencoderKLMiniMaxH3Audio.from_pretrained(
                p, subfolder="audio_vae", dtype=torch.float32), p / "audio_vae")
            modules.append(audio_vae)
        for module in modules:
            module.requires_grad_(False).eval().to(device)
        return SimpleNamespace(tokenizer=tokenizer, processor=processor,
                               text_encoder=text_encoder, vae=vae, audio_vae=audio_vae,
                               _execution_device=device)

    @cached_property
    def transformer_config(self) -> dict[str, Any]:
        """What the original layout's key table needs of the transformer's config."""
        keys = ("num_layers", "num_refiner_layers", "num_attention_heads", "attention_head_dim")
        values = denoiser_config(self.path / "transformer", "MiniMaxH3Transformer3DModel", *keys)
        return dict(zip(keys, values))

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) or (B, 3, F, H, W) in [-1, 1] -> (B, C, F', h, w): the VAE's mean
        of the ImageNet-normalised pixels (the pipeline's pixel convention), normalised."""
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        frames = pixels.shape[2]
        _, clip, per_chunk = self.vae_geometry
        if frames != 1 and frames % clip != per_chunk:
            raise DataError(
                f"MiniMax H3's VAE takes {clip}k+{per_chunk} frames (or one image); got a clip of "
                f"{frames}: use frame buckets such as {clip + per_chunk}, {2 * clip + per_chunk}, "
                f"{7 * clip + per_chunk} in dataset.frame_buckets")
        vae = encoders.vae
        mean = torch.tensor(PIXEL_MEAN, device=vae.device).view(1, 3, 1, 1, 1)
        std = torch.tensor(PIXEL_STD, device=vae.device).view(1, 3, 1, 1, 1)
        x = ((pixels.to(vae.device, torch.float32) + 1) / 2 - mean) / std
        latents = vae.encode(x.to(vae.dtype)).latent_dist.mode().float()
        shape = (1, -1, 1, 1, 1)
        z_mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(shape)
        z_std = torch.tensor(vae.config.latents_std, device=latents.device).view(shape)
        return (latents - z_mean) / z_std

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """MiniMaxH3TextEncoderStep's prompt_embeds per prompt, padded to max_text_tokens, with
        their (B, max_text_tokens) mask. An empty prompt (the sampler's unused negative prompt)
        encodes to no tokens: the pipeline has none to give it."""
        from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

        n = self.cfg.max_text_tokens
        embeds, masks = [], []
        for prompt in prompts:
            ids = encoders.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not ids:  # an all-zero mask: refused where it would train (`make_inputs`)
                embeds.append(torch.zeros(n, encoders.text_encoder.config.text_config.hidden_size,
                                          dtype=encoders.text_encoder.dtype,
                                          device=encoders.text_encoder.device))
                masks.append(torch.zeros(n, dtype=torch.long, device=embeds[-1].device))
                continue
            if len(ids) > n:
                raise DataError(
                    f"a caption of {len(ids)} tokens is longer than model.max_text_tokens={n} "
                    f"(MiniMax H3 reads the whole prompt): raise model.max_text_tokens to "
                    f"{len(ids)} or shorten it: {prompt[:80]!r}")
            x = get_qwen3vl_prompt_embeds(
                encoders.text_encoder, encoders.processor, ids, {}, text_encoder_layer=TEXT_LAYER,
                device=encoders.text_encoder.device, dtype=encoders.text_encoder.dtype)[0]
            embeds.append(nn.functional.pad(x, (0, 0, 0, n - x.shape[0])))
            mask = torch.zeros(n, dtype=torch.long, device=x.device)
            mask[:x.shape[0]] = 1
            masks.append(mask)
        out = {"qwen": torch.stack(embeds), "qwen_mask": torch.stack(masks)}
        if self.guided:  # the unconditional prompt beside each caption, at its own length
            probe = self.encode_prompts_unguided(encoders, UNCOND_PROBE)
            out["uncond"] = probe.expand(len(prompts), -1, -1)
            out["uncond_mask"] = torch.ones(out["uncond"].shape[:2], dtype=torch.long,
                                            device=probe.device)
        return out

    def encode_prompts_unguided(self, encoders: Any, prompt: str) -> torch.Tensor:
        """One prompt's embeds, (1, tokens, D), unpadded."""
        from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

        ids = encoders.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return get_qwen3vl_prompt_embeds(
            encoders.text_encoder, encoders.processor, ids, {}, text_encoder_layer=TEXT_LAYER,
            device=encoders.text_encoder.device, dtype=encoders.text_encoder.dtype)

    # ---- audio -------------------------------------------------------------------------------
    def audio_format(self) -> AudioFormat | None:
        if not self.cfg.audio:
            return None
        rate = read_json(self.path / "audio_vae" / "config.json").get("sampling_rate", SAMPLE_RATE)
        return AudioFormat(sample_rate=rate, channels=AUDIO_CHANNELS)

    # ---- training ----------------------------------------------------------------------------
    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return minimax_h3_layers(denoiser, self.cfg.guidance)

    def make_inputs(self, batch: NoisedBatch):
        latents = batch.latents
        frames, height, width = latents.shape[2:]
        video = patchify(batch.noisy, self.patch)
        target = patchify(batch.target, self.patch)
        # The transformer's t (1 is clean) of the video rows and of the audio rows: the audio's
        # own in sampling (its schedule is shifted otherwise), the video's in training.
        audio_t = getattr(batch, "audio_timesteps", None)
        sigmas = torch.stack([batch.timesteps, batch.timesteps if audio_t is None else audio_t], 1)
        t = (1 - sigmas).to(latents.dtype)
        mask = batch.text["qwen_mask"]
        lengths = [int(n) for n in mask.sum(dim=1).tolist()]  # CPU: where batches are made
        if min(lengths) == 0:
            raise DataError(
                "an empty caption: MiniMax H3 is guidance-distilled and has no empty-prompt "
                "conditioning; give every item a caption and leave caption dropout at 0")
        text = batch.text["qwen"]
        augment = self.guided and not getattr(batch, "sampling", False)
        if augment:  # B more sequences: each sample with the unconditional prompt
            if "uncond" not in batch.text:
                raise DataError("model.guidance > 1 (CFG-augmented training) needs the "
                                "unconditional prompt cached with each caption: re-cache")
            uncond = batch.text["uncond"]
            lengths += [int(n) for n in batch.text["uncond_mask"].sum(dim=1).tolist()]
            longest = max(text.shape[1], uncond.shape[1])
            text = torch.cat([nn.functional.pad(x, (0, 0, 0, longest - x.shape[1]))
                              for x in (text, uncond)])
        text = text[:, :max(lengths)]
        # Audio rows: the dataset's with model.audio=true, and always in sampling (t2va).
        audio = getattr(batch, "audio_noisy", None)
        if audio is None and self.cfg.audio and frames > 1:
            raise DataError(
                "model.audio=true, but this micro-batch of clips carries no audio latents: the "
                "dataset gave none (images train without audio; clips need their audio track "
                "decoded and cached by the dataset); set model.audio=false to train video only")
        audio_latents = 0 if audio is None else audio.shape[1] // AUDIO_CHANNELS
        layout = carrier(frames, height, width, audio_latents,
                         latents.shape[0] if augment else 0)
        media = (video,) if audio is None else (video, audio)
        inputs = (*media, t, text, carrier(*lengths), layout)
        labels = (target,) if audio is None else (target, getattr(batch, "audio_target", audio))
        weight = getattr(batch, "loss_weight", None)  # masks, (B, 1, 1, h, w), or None
        if weight is not None:
            weight = patchify(weight.expand_as(latents).to(latents.dtype), self.patch)
            labels += (weight,)
        return inputs, labels

    def prior_labels(self, outputs: torch.Tensor, labels: tuple, rows: list[int]) -> tuple:
        """With audio rows, the video's and the audio's targets of `rows` both become the base
        model's predictions (split from the joined output, as `loss` splits it)."""
        if outputs.ndim != 2:
            return super().prior_labels(outputs, labels, rows)
        target, audio_target, *weight = labels
        video, audio = split_prediction(outputs, target.shape, audio_target.shape)
        return (replace_rows(target, video, rows), replace_rows(audio_target, audio, rows),
                *weight)

    def loss(self, outputs, labels) -> torch.Tensor:
        """The video rows' loss; with audio rows, plus model.audio_loss_weight x the audio's,
        each sample's weighted by its video weights' mean (`per_sample_weight`)."""
        if outputs.ndim == 2:  # the video's and the audio's predictions joined (layers.py)
            target, audio_target, *weight = labels
            video, audio = split_prediction(outputs, target.shape, audio_target.shape)
            sound_weight = per_sample_weight(weight[0] if weight else None, audio)
            return (weighted_mean(self.element_error(video, target), *weight)
                    + self.cfg.audio_loss_weight
                    * weighted_mean(self.element_error(audio, audio_target), sound_weight))
        return super().loss(outputs, labels)

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs, sample_shapes = SIZES, SAMPLE_SHAPES

    def bench_folder(self, size: str) -> dict[str, dict[str, Any]]:
        return {"transformer/config.json": SIZES[size], "vae/config.json": RELEASE_VAE}

    def random_sample(self, size: str):
        """The size's latents and prompt; with model.guidance > 1, the unconditional prompt
        beside it, one token (the single-space probe's length is the text encoder's)."""
        shapes = self.sample_shapes[size]
        n, valid = shapes["text"], shapes["valid"]
        mask = torch.zeros(n, dtype=torch.long)
        mask[:valid] = 1
        text = {"qwen": torch.randn(n, shapes["text_dim"]) * mask[:, None], "qwen_mask": mask}
        if self.guided:
            text["uncond"] = torch.randn(1, shapes["text_dim"])
            text["uncond_mask"] = torch.ones(1, dtype=torch.long)
        return torch.randn(shapes["latents"]), text

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        """6 (full) or 4 (LoRA) x parameters x rows, plus self-attention over the packed rows."""
        video, *rest = inputs
        text = rest[-3]
        audio = rest[0].shape[1] if len(rest) == 5 else 0
        c = denoiser.config
        rows = video.shape[1] + audio + text.shape[1]
        width = c.num_attention_heads * c.attention_head_dim
        attention = c.num_layers * attention_train_flops(rows, width)
        return video.shape[0] * ((6 if full else 4) * model_params(denoiser) * rows + attention)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        config = self.transformer_config
        return [LoraFormat(COMFYUI_LORA,
                           lambda: lora_to_comfyui(weights, lora_scale(metadata), config),
                           {"format": "comfyui"})]

    def export_single_file(self, folder: Path, out_dir: Path) -> Path:
        # The original names are a function of the config (the block count, the heads).
        config = self.transformer_config
        return export_like_source(folder, self.single_file,
                                  lambda w: original_state_dict(w, config), out_dir)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs):
        """As the pipeline's denoiser step calls the transformer, one sample at a time (its
        layout is the sample's own), the video's and the audio's t as its two timesteps; the
        output as the head's."""
        if len(inputs) == 6:
            video, audio, t, text, text_lengths, layout = inputs
        else:
            (video, t, text, text_lengths, layout), audio = inputs, None
        frames, height, width, audio_latents, guided = sizes(layout)
        b = video.shape[0]
        videos, audios = [], []
        for i, n in enumerate(sizes(text_lengths)):
            j = i % b  # sequences b.. (CFG-augmented training): sample i - b, unconditional
            positions, tags, v_rows, a_rows, t_rows, time_index, _ = packed_layout(
                n, frames, height, width, audio_latents, self.patch)
            device = video.device
            sound = (audio[j:j + 1] if audio is not None
                     else video.new_zeros(1, 0, denoiser.config.audio_in_channels))
            v, a = denoiser(
                hidden_states=video[j:j + 1], audio_hidden_states=sound,
                encoder_hidden_states=text[i:i + 1, :n], timestep=t[j],
                timestep_indices=time_index.to(device), token_tags=tags.to(device),
                position_ids=positions.to(device), video_indices=v_rows.to(device),
                audio_indices=a_rows.to(device), text_indices=t_rows.to(device),
                return_dict=False)
            videos.append(v)
            audios.append(a)
        out = torch.cat(videos)
        if audio is not None:
            out = torch.cat([out.flatten(1), torch.cat(audios).flatten(1)], dim=1)
        return cfg_augmented(out, b, self.cfg.guidance) if guided else out
