"""SDXL base (and its fine-tunes): UNet2DConditionModel + AutoencoderKL + CLIP-L + OpenCLIP-bigG.

`model.path` is either the diffusers folder (stabilityai/stable-diffusion-xl-base-1.0 layout) or a
single-file checkpoint (`.safetensors` in Stability's names, as fine-tunes are shared); for a single
file, `model.single_file_config` may name a diffusers folder or hub id with the configs and
tokenizers (default: diffusers' SDXL base config from the hub cache).

Objective: discrete DDPM (see `ddpm.py`): epsilon or v-prediction (`model.prediction_type`, default:
the scheduler config's), optional min-SNR-gamma weighting (`model.min_snr_gamma`) and debiased
estimation (`model.debiased_estimation`). SDXL was trained
on uniformly sampled timesteps: use `train.timesteps.sampling=uniform` (and shift 1).
Conditioning: both encoders' penultimate hidden states (concatenated, 77 tokens) and CLIP-G's pooled
projection through `StableDiffusionXLPipeline.encode_prompt`, plus SDXL's six size/crop numbers
(original size, crop top-left, target size): the file's size and the offset of the crop that
fitted it to its bucket, from the dataset (`NoisedBatch.original_size` / `crop_top_left`), as
diffusers' SDXL training script computes them; (size, (0, 0), size) of the trained image for a
batch made without a dataset.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.config.schema import TimestepWeighting
from dpipe.errors import ConfigError, ModelLoadError
from dpipe.models import tiny_stamp
from dpipe.models.common.quantized_files import file_is_quantized
from dpipe.models.diffusers_folder import read_json
from dpipe.models.fingerprint import file_fingerprint, folder_fingerprint
from dpipe.models.family import DiffusersFamily
from dpipe.models.lora_files import LoraFormat
from dpipe.models.sdxl import ddpm
from dpipe.models.sdxl.costs import nominal_inputs
from dpipe.models.sdxl.layers import sdxl_layers
from dpipe.models.sdxl.ldm import unet_from_single_file
from dpipe.models.single_file import read_single_file
from dpipe.models.single_file_weights import file_skeleton, reads_by_tensor
from dpipe.models.spec import NoisedBatch, PipelineLayer, counted_layer_flops, denoiser_config

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")
KOHYA_FILE = "lora_kohya.safetensors"

# kohya's default for SDXL LoRAs (what ComfyUI/A1111 users train and share): every Linear of the
# UNet's transformer blocks -- attention projections, feed-forwards, proj_in/out -- and no conv.
LORA_TARGETS = (r"(?:down_blocks\.\d+|mid_block|up_blocks\.\d+)\.attentions\.\d+\.(?:proj_in|proj_out"
                r"|transformer_blocks\.\d+\.(?:attn[12]\.(?:to_q|to_k|to_v|to_out\.0)"
                r"|ff\.net\.0\.proj|ff\.net\.2))")


def ddpm_loss(error: torch.Tensor, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Each sample's mean per-element `error` (times the per-pixel mask weights, where given),
    weighted by the sample's min-SNR / debiased weight. Labels: (target, weights[, mask])."""
    _target, weights, *mask = labels
    if mask:
        error = error * mask[0].float()
    return (error.flatten(1).mean(1) * weights.float()).mean()


class SDXLSpec(DiffusersFamily):
    family = "sdxl"
    title, example = "SDXL", "stabilityai/stable-diffusion-xl-base-1.0"
    pipeline_class, denoiser_class = "StableDiffusionXLPipeline", "UNet2DConditionModel"
    denoiser_folder = lora_component = "unet"
    required_parts = ("model_index.json", "unet", "vae", "text_encoder", "text_encoder_2",
                      "tokenizer", "tokenizer_2", "scheduler")
    lora_modules = LORA_TARGETS
    layers = sdxl_layers
    error_loss = ddpm_loss
    sampler = "dpipe.models.sdxl.sampling:SDXLSampling"
    # model.path may be one checkpoint of the whole pipeline (UNet, VAE and both text encoders in
    # Stability's names), read through diffusers' from_single_file: `self.single_file` says so,
    # and the methods that read the folder below read either.

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.prediction_type not in (None, *ddpm.PREDICTION_TYPES):
            raise ConfigError(f"model.prediction_type={cfg.prediction_type!r}: SDXL predicts "
                              f"{' or '.join(ddpm.PREDICTION_TYPES)} (null: the checkpoint's own)")
        if cfg.min_snr_gamma < 0:
            raise ConfigError(f"model.min_snr_gamma={cfg.min_snr_gamma} must be >= 0 (0: off)")
        # The checkpoint where model.path is one (truthy), else None, as DiffusersFamily's.
        self.single_file = self.path if self.path.suffix in SINGLE_FILE_SUFFIXES else None
        if cfg.single_file_config is not None and not self.single_file:
            raise ConfigError("model.single_file_config is only used when model.path is a single-"
                              f"file checkpoint ({', '.join(SINGLE_FILE_SUFFIXES)})")
        self._schedule: tuple[torch.Tensor, str] | None = None
        self._unet_config: dict[str, Any] | None = None

    def use_loss(self, train) -> None:
        super().use_loss(train)
        if train.timesteps.weighting != TimestepWeighting.none:  # weights of a flow's sigma
            raise ConfigError(
                f"train.timesteps.weighting={train.timesteps.weighting.value} weighs flow-matching "
                "noise levels; SDXL's DDPM loss has its own weights: set "
                "train.timesteps.weighting=none and use model.min_snr_gamma or "
                "model.debiased_estimation=true")

    # ---- where the configs live ---------------------------------------------------------------
    @property
    def _config_dir(self) -> Path | None:
        """A local diffusers folder with the component configs, if there is one."""
        if not self.single_file:
            return self.path
        if self.cfg.single_file_config and Path(self.cfg.single_file_config).expanduser().is_dir():
            return Path(self.cfg.single_file_config).expanduser()
        return None

    def _json(self, part: str, name: str = "config.json") -> dict[str, Any] | None:
        folder = self._config_dir
        if folder is None:
            return None
        return read_json(folder / part / name)

    def ensure_available(self) -> None:
        if self.cfg.tiny:
            from dpipe.models.sdxl.tiny import SINGLE_FILE, make_tiny_sdxl

            folder = self.path.parent if self.path.name == SINGLE_FILE else self.path
            if tiny_stamp.needs_writing(folder):
                make_tiny_sdxl(folder)
        if not self.path.exists():
            raise ModelLoadError(
                f"model.path={self.path} does not exist. Give an SDXL model: its diffusers folder "
                "(e.g. stabilityai/stable-diffusion-xl-base-1.0) or a single .safetensors file")
        config = self.cfg.single_file_config
        if self.single_file:
            # A hub id ("org/name") is fine; a path that names no folder is a typo.
            if config and config.startswith(("/", ".", "~")) and self._config_dir is None:
                raise ModelLoadError(f"model.single_file_config={config} is not a folder")
        else:
            missing = [p for p in self.required_parts if not (self.path / p).exists()]
            if missing:
                raise ModelLoadError(
                    f"model.path={self.path} is not a complete SDXL diffusers folder: missing "
                    f"{', '.join(missing)}")
        self._json("vae")
        self._json("unet")

    @property
    def pixel_multiple(self) -> int:
        vae, unet = self._json("vae"), self._json("unet")
        if vae is None or unet is None:
            return 32  # SDXL's own: the VAE's 8x times the UNet's two 2x downsamplings
        return 2 ** (len(vae["block_out_channels"]) - 1) * 2 ** (len(unet["down_block_types"]) - 1)

    # ---- components -------------------------------------------------------------------------
    def _pipeline(self, dtype: torch.dtype | None = None, **components):
        from diffusers import StableDiffusionXLPipeline

        try:
            if self.single_file:
                return StableDiffusionXLPipeline.from_single_file(
                    str(self.path), config=self.cfg.single_file_config, torch_dtype=dtype,
                    **components)
            return StableDiffusionXLPipeline.from_pretrained(self.path, dtype=dtype, **components)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load SDXL from {self.path}: {err}") from None

    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        pipe = self._pipeline(dtype, unet=None)
        pipe.to(device)
        for module in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
            module.requires_grad_(False).eval()
        return pipe

    @property
    def loads_stage_weights(self) -> bool:
        # Its load_denoiser is the default for a diffusers folder (its own is for single files
        # only): each stage reads its weights from a folder as every default family does, and
        # from a safetensors checkpoint whose configs are a local folder (a hub id's configs
        # are diffusers' to fetch, in the whole load).
        if self.single_file is None:
            return True
        return self._config_dir is not None and reads_by_tensor(self.single_file)

    def denoiser_skeleton(self):
        """From a folder as every family; from a checkpoint through diffusers' own converter
        (`ldm.unet_from_single_file`), the file's UNet tensors of the stage alone."""
        if self.single_file is None or not self.loads_stage_weights:
            return super().denoiser_skeleton()
        from diffusers import UNet2DConditionModel

        return file_skeleton(UNet2DConditionModel, self._config_dir / "unet", self.single_file,
                             unet_from_single_file, "UNet2DConditionModel")

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        if self.single_file is None:
            return super().load_denoiser(dtype)
        from diffusers import UNet2DConditionModel

        try:
            # A quantized file goes in dequantized: diffusers' converter would keep the 8-bit
            # values and drop their scales.
            source = (read_single_file(self.path, dtype) if file_is_quantized(self.path)
                      else str(self.path))
            unet = UNet2DConditionModel.from_single_file(
                source, config=self.cfg.single_file_config, subfolder="unet", torch_dtype=dtype)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the SDXL UNet from {self.path}: {err}") from None
        self._unet_config = dict(unet.config)  # the configs may be the hub's, not a folder's
        return unet

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        base = {"family": self.family, "single_file_config": self.cfg.single_file_config}
        if self.single_file:
            # One file holds every component: its identity covers the VAE and both encoders.
            base["checkpoint"] = file_fingerprint(self.path)
            if self._config_dir is not None:
                base["configs"] = [folder_fingerprint(self._config_dir / p) for p in
                                   ("vae", "text_encoder", "text_encoder_2", "tokenizer",
                                    "tokenizer_2")]
            if kind == "image":
                base["latent"] = "mode"
            return base
        if kind == "image":
            vae = self._json("vae")
            return {**base, "vae": folder_fingerprint(self.path / "vae"), "latent": "mode",
                    "scaling_factor": vae.get("scaling_factor")}
        return {**base, **{p: folder_fingerprint(self.path / p) for p in
                           ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")}}

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        text, _neg, pooled, _neg_pooled = encoders.encode_prompt(
            prompts, device=encoders.vae.device, num_images_per_prompt=1,
            do_classifier_free_guidance=False)
        return {"text": text, "pooled": pooled}

    # ---- objective ---------------------------------------------------------------------------
    def _objective(self) -> tuple[torch.Tensor, str]:
        """(alphas_cumprod, prediction type) of this checkpoint."""
        if self._schedule is None:
            config = self._json("scheduler", "scheduler_config.json")
            if config is None:  # a single file with hub configs: read them through diffusers
                config = dict(self._pipeline_scheduler_config())
            prediction = self.cfg.prediction_type or config.get("prediction_type", "epsilon")
            if prediction not in ddpm.PREDICTION_TYPES:
                raise ConfigError(f"the scheduler of {self.path} predicts {prediction!r}; dpipe "
                                  f"trains SDXL on {' or '.join(ddpm.PREDICTION_TYPES)}")
            self._schedule = (ddpm.alphas_cumprod(config), prediction)
        return self._schedule

    def _pipeline_scheduler_config(self):
        from diffusers import EulerDiscreteScheduler

        repo = self.cfg.single_file_config or "stabilityai/stable-diffusion-xl-base-1.0"
        return EulerDiscreteScheduler.load_config(repo, subfolder="scheduler")

    def _abar(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        alphas, _ = self._objective()
        steps = ddpm.discrete_timesteps(t, len(alphas))
        return steps, alphas[steps]

    def noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
        _, prediction = self._objective()
        _, abar = self._abar(t)
        return ddpm.noisy_and_target(x0, noise, abar, prediction)

    # ---- training ----------------------------------------------------------------------------
    def pipeline_layer_count(self) -> int | None:
        """sdxl_layers: the embedding; each down block's resnets (with their transformers) and
        its downsampler; the mid block; each up block's resnets (one more than a down block's)
        and its upsampler; the head. Every block but the last (down) or first (up) resamples.
        From the UNet's config, or else from a single file's tensor names; None for a single
        .ckpt without a config folder (a pickle, unread before the workers)."""
        if self._config_dir is not None:
            per_block, kinds = denoiser_config(self._config_dir / "unet", "UNet2DConditionModel",
                                               "layers_per_block", "down_block_types")
            blocks = len(kinds)
            resnets = sum(per_block) if isinstance(per_block, list) else per_block * blocks
            return 3 + 2 * resnets + blocks + 2 * (blocks - 1)
        if self.path.suffix != ".safetensors":
            return None
        import re

        from safetensors import SafetensorError, safe_open

        from dpipe.models.sdxl.ldm import UNET_PREFIX

        # SGM's names: input_blocks.0 is conv_in, then one per resnet or downsampler;
        # output_blocks hold a resnet each, some with an upsampler (`.<i>.conv`) in them.
        try:
            with safe_open(self.path, "pt") as f:  # the header only, no tensor
                names = [k.removeprefix(UNET_PREFIX) for k in f.keys()
                         if k.startswith(UNET_PREFIX)]
        except (OSError, SafetensorError) as err:
            raise ModelLoadError(f"cannot read model.path={self.path}: {err}") from None
        inputs = {n.split(".")[1] for n in names if n.startswith("input_blocks.")}
        outputs = {n.split(".")[1] for n in names if n.startswith("output_blocks.")}
        upsamplers = {n.split(".")[1] for n in names
                      if re.fullmatch(r"output_blocks\.\d+\.\d+\.conv\.weight", n)}
        return 2 + (len(inputs) - 1) + 1 + len(outputs) + len(upsamplers)

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """Forward FLOPs per layer at 1024^2 (dpipe.models.sdxl.costs): parameter counts
        misweigh a UNet's layers, whose work follows the resolution they run at."""
        device = next(layers[0].parameters()).device
        inputs = nominal_inputs(self._unet_config_dict(), self._vae_scale(), device)
        return counted_layer_flops(layers, inputs)

    def make_inputs(self, batch: NoisedBatch):
        steps, abar = self._abar(batch.timesteps)
        b, _, h, w = batch.latents.shape
        scale = self._vae_scale()
        target = torch.tensor([[h * scale, w * scale]], dtype=torch.long).expand(b, 2)
        original = getattr(batch, "original_size", None)
        crop = getattr(batch, "crop_top_left", None)
        # SDXL's micro-conditioning: (original h, w), (crop top, left), (target h, w).
        time_ids = torch.cat([target if original is None else original,
                              torch.zeros_like(target) if crop is None else crop, target],
                             dim=1).to(batch.noisy.dtype)
        _, prediction = self._objective()
        weights = ddpm.loss_weights(abar, prediction, self.cfg.min_snr_gamma,
                                    self.cfg.debiased_estimation)
        inputs = (batch.noisy, steps, batch.text["text"], batch.text["pooled"], time_ids)
        mask = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        return inputs, (batch.target, weights) if mask is None else (batch.target, weights, mask)

    def _vae_scale(self) -> int:
        vae = self._json("vae")
        return 8 if vae is None else 2 ** (len(vae["block_out_channels"]) - 1)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        from dpipe.models.sdxl.ldm import kohya_lora

        # LoKr and LoHa name it "alpha" (their kohya file is not written: adapter_formats)
        rank, alpha = metadata["r"], metadata.get("lora_alpha", metadata.get("alpha"))
        return [LoraFormat(KOHYA_FILE, lambda: kohya_lora(weights, self._unet_config_dict(), alpha),
                           {"ss_network_module": "networks.lora", "ss_network_dim": str(rank),
                            "ss_network_alpha": str(alpha),
                            "ss_base_model_version": "sdxl_base_v1-0"})]

    def _unet_config_dict(self) -> dict[str, Any]:
        if self._unet_config is None:
            self._unet_config = self._json("unet") or dict(self.load_denoiser(torch.float32).config)
        return self._unet_config

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        from dpipe.models.diffusers_folder import write_denoiser_folder

        config = self._config_dir / "unet" / "config.json" if self._config_dir else None
        with tempfile.TemporaryDirectory() as tmp:
            if config is None:  # a single file with hub configs: the loaded UNet's own config
                config = Path(tmp) / "config.json"
                config.write_text(json.dumps(self._unet_config_dict(), indent=2, default=list))
            return write_denoiser_folder(shards, out_dir / "unet", config)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        sample, steps, text, pooled, time_ids = inputs
        return denoiser(sample, steps, encoder_hidden_states=text, return_dict=False,
                        added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids})[0]

    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        pipe = self._pipeline(None, vae=None, text_encoder=None, text_encoder_2=None,
                              tokenizer=None, tokenizer_2=None)
        pipe.load_lora_weights(str(lora_dir))  # picks pytorch_lora_weights.safetensors
        return pipe.unet
