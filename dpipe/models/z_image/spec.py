"""Z-Image (Turbo / base): ZImageTransformer2DModel + AutoencoderKL (FLUX's VAE) + Qwen3 text encoder.

Loads the diffusers folder layout of Tongyi-MAI/Z-Image-Turbo; prompts go through diffusers'
own `ZImagePipeline.encode_prompt` (Qwen3 chat template, second-to-last hidden state, padding
dropped), so training sees exactly what inference sees.

Conventions of the family, from `ZImagePipeline.__call__`: the transformer is given
t_model = 1 - sigma (1 = clean image) and its output is the negated flow velocity, x0 - noise
(the pipeline steps with `-output`). `noise` below sets the target to match, so the loss is the
usual flow-matching MSE.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.flow_matching import noisy_latents, velocity_target
from dpipe.diffusion.loss import weighted_labels, weighted_mean
from dpipe.models.comfyui import comfy_lora_tensors, fused_pair, peft_pairs
from dpipe.models.common.shapes import round_up
from dpipe.models.diffusers_folder import (
    check_folder, kl_image_fingerprint, kl_latents, load_denoiser, load_encoders, read_json)
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, LoraFormat, peft_to_diffusers, save_diffusers_lora,
    write_lora_files)
from dpipe.models.refined_joint import (
    NOMINAL_IMAGE_TOKENS, layer_forward_flops, refined_joint_train_flops)
from dpipe.models.single_file import check_single_file, load_or_fail, split_path
from dpipe.models.spec import ModelSpec, NoisedBatch, PipelineLayer, denoiser_config
from dpipe.models.z_image.layers import SEQ_MULTI_OF, z_image_layers
from dpipe.models.z_image.sizes import SAMPLE_SHAPES, SIZES

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer")

# Every Linear of every ZImageTransformerBlock (main layers and both refiners): attention,
# SwiGLU MLP and the adaLN modulation, as the community's Z-Image LoRAs target them.
_BLOCK_LINEARS = [r"attention\.to_q", r"attention\.to_k", r"attention\.to_v", r"attention\.to_out\.0",
                  r"feed_forward\.w1", r"feed_forward\.w2", r"feed_forward\.w3", r"adaLN_modulation\.0"]
LORA_TARGETS = r"(?:layers|noise_refiner|context_refiner)\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"

# Weights that see one token per sample, and the embedder's that see the caption's (layer_costs).
PER_SAMPLE_WEIGHTS = ("t_embedder", "adaLN_modulation")
TEXT_WEIGHTS = ("cap_embedder",)
COMFY_LORA = "comfyui_lora.safetensors"


class ZImageSpec(ModelSpec):
    family = "z_image"

    def __init__(self, cfg):
        super().__init__(cfg)
        # model.path: the diffusers folder, or a single-file transformer (ComfyUI's / the original
        # layout) with model.single_file_config naming the diffusers folder for the rest.
        self.path, self.single_file = split_path(cfg)

    def ensure_available(self) -> None:
        if self.cfg.tiny and not self.path.exists():
            from dpipe.models.z_image.tiny import make_tiny_z_image

            make_tiny_z_image(self.path)
        check_folder(self.path, REQUIRED_PARTS, "Z-Image", "Tongyi-MAI/Z-Image-Turbo")
        check_single_file(self.single_file)
        self._vae_config()  # a broken folder fails before training

    def _vae_config(self) -> dict[str, Any]:
        return read_json(self.path / "vae" / "config.json")

    def _transformer_config(self) -> dict[str, Any]:
        return read_json(self.path / "transformer" / "config.json")

    @property
    def pixel_multiple(self) -> int:
        # VAE downscale (x8 for the real model), then 2x2 patches.
        patch = self._transformer_config().get("all_patch_size", [2])[0]
        return 2 ** (len(self._vae_config()["block_out_channels"]) - 1) * patch

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import ZImagePipeline

        return load_encoders(ZImagePipeline, self.path, device, dtype,
                             frozen=("vae", "text_encoder"))

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        from diffusers import ZImageTransformer2DModel

        if self.single_file is not None:  # diffusers converts the original names
            return load_or_fail(lambda: ZImageTransformer2DModel.from_single_file(
                str(self.single_file), config=str(self.path), subfolder="transformer",
                torch_dtype=dtype), self.single_file)
        return load_denoiser(ZImageTransformer2DModel, self.path, None, dtype)

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "image":
            return kl_image_fingerprint(self.family, self.path)
        return {
            "family": self.family,
            "text_encoder": folder_fingerprint(self.path / "text_encoder"),
            "tokenizer": folder_fingerprint(self.path / "tokenizer"),
            "max_text_tokens": self.cfg.max_text_tokens,
            "layout": "chat template, hidden_states[-2], padding dropped, zero-padded + length",
        }

    # ---- caching -----------------------------------------------------------------------------
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        return kl_latents(encoders.vae, pixels)

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = encoders.encode_prompt(
            list(prompts), device=encoders.vae.device, do_classifier_free_guidance=False,
            max_sequence_length=self.cfg.max_text_tokens)
        # Variable-length per prompt: cached zero-padded to max_text_tokens with the length, so
        # every entry has one shape; the layers drop the padding again.
        length = self.cfg.max_text_tokens
        padded = embeds[0].new_zeros(len(embeds), length, embeds[0].shape[-1])
        for i, e in enumerate(embeds):
            padded[i, : e.shape[0]] = e
        lengths = torch.tensor([[e.shape[0]] for e in embeds], dtype=torch.float32)
        return {"cap": padded, "cap_len": lengths}

    # ---- training ----------------------------------------------------------------------------
    def lora_targets(self) -> str:
        return LORA_TARGETS

    def noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
        # Z-Image predicts x0 - noise (the pipeline negates its output before stepping).
        return noisy_latents(x0, noise, t), -velocity_target(x0, noise)

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return z_image_layers(denoiser)

    def pipeline_layer_count(self) -> int:
        """z_image_layers: the embedding, the image's and the caption's refiner blocks, the join,
        every main block, the head."""
        refiners, blocks = denoiser_config(
            self.path / "transformer", "ZImageTransformer2DModel", "n_refiner_layers", "n_layers")
        return 3 + 2 * refiners + blocks

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """Forward FLOPs per layer at a 1024x1024 image and the longest caption
        (`dpipe.models.refined_joint`): the caption refiners run a block's weights over the
        caption alone, the timestep embedder and the modulations once per sample."""
        return layer_forward_flops(layers, NOMINAL_IMAGE_TOKENS,
                                   round_up(self.cfg.max_text_tokens, SEQ_MULTI_OF),
                                   per_sample=PER_SAMPLE_WEIGHTS, text_weights=TEXT_WEIGHTS)

    def make_inputs(self, batch: NoisedBatch):
        t_model = 1.0 - batch.timesteps  # the pipeline's (1000 - t) / 1000
        cap_len = batch.text["cap_len"].reshape(-1).round().long()
        # Cut after the longest caption (the cache pads to max_text_tokens). diffusers pads each
        # caption to a multiple of 32 with its pad token, which is attended, and the batch to the
        # longest: only that batch padding needs a mask, and none is left for one item. On the
        # CPU, where batches are made: reading a GPU mask would make the host wait.
        cap = batch.text["cap"][:, :max(int(cap_len.max()), 1)]
        padded = torch.arange(round_up(cap.shape[1], SEQ_MULTI_OF))
        cap_mask = (padded[None, :] < round_up(cap_len, SEQ_MULTI_OF)[:, None]).long()
        if bool(cap_mask.all()):
            cap_mask = cap_mask[:, :0]  # nothing to mask (attention_mask.has_padding)
        return (batch.noisy, t_model, cap, cap_len, cap_mask), weighted_labels(batch)

    def loss(self, outputs, labels) -> torch.Tensor:
        return weighted_mean(self.element_error(outputs, labels[0]), *labels[1:])

    # ---- export ------------------------------------------------------------------------------
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        from diffusers import ZImagePipeline

        weights = peft_to_diffusers(state_dict)
        return write_lora_files(
            out_dir, lambda: save_diffusers_lora(ZImagePipeline, weights, metadata, out_dir),
            [LoraFormat(COMFY_LORA, lambda: comfy_lora_tensors(
                comfy_lora_pairs(weights, metadata["lora_alpha"])), {"format": "pt"})])

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        from dpipe.models.diffusers_folder import write_transformer_folder

        return write_transformer_folder(shards, out_dir, self.path)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, t_model, cap, cap_len, _cap_mask = inputs
        x = [lat.unsqueeze(1) for lat in latents]  # (C, F=1, H, W) per item
        caps = [c[: int(n)] for c, n in zip(cap, cap_len)]
        out = denoiser(x, t_model, caps, return_dict=False)[0]
        return torch.stack(out).squeeze(2)

    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        from diffusers import ZImagePipeline

        pipe = ZImagePipeline.from_pretrained(self.path, text_encoder=None, vae=None,
                                              tokenizer=None,
                                              transformer=self.load_denoiser(torch.float32))
        pipe.load_lora_weights(str(lora_dir), weight_name=DIFFUSERS_LORA)
        return pipe.transformer

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        from diffusers import ZImageTransformer2DModel

        return ZImageTransformer2DModel.from_pretrained(export_dir / "transformer")

    def sampling(self):
        from dpipe.models.z_image.sampling import ZImageSampling

        return ZImageSampling(self)

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        text = {"cap": torch.randn(shapes["cap"]),
                "cap_len": torch.tensor([float(shapes["text_tokens"])])}
        return torch.randn(shapes["latents"]), text

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        latents, _t, cap = inputs[:3]
        b, _, h, w = latents.shape
        p = denoiser.config.all_patch_size[0]
        # diffusers pads each stream to a multiple of 32 tokens, attended (layers.py).
        image, text = (round_up(n, SEQ_MULTI_OF) for n in ((h // p) * (w // p), cap.shape[1]))
        return refined_joint_train_flops(denoiser, b, image, text, denoiser.config.dim,
                                         denoiser.t_embedder, full)


# ---- ComfyUI ------------------------------------------------------------------------------------
# ComfyUI runs Z-Image with the original checkpoint's module names (those of the single-file
# `z_image_turbo_bf16.safetensors`): fused attention.qkv, attention.out, x_embedder, final_layer.
# diffusers' `convert_z_image_transformer_checkpoint_to_diffusers` maps them the other way.
_TO_NATIVE = {".attention.to_out.0": ".attention.out", "all_final_layer.2-1.": "final_layer.",
              "all_x_embedder.2-1.": "x_embedder."}


def native_module_name(name: str) -> str:
    for diffusers_name, native in _TO_NATIVE.items():
        name = name.replace(diffusers_name, native)
    return name


def native_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers ZImageTransformer2DModel state dict under the original (ComfyUI) names: the
    inverse of diffusers' single-file conversion (q/k/v fused into qkv, norm_q -> q_norm, ...)."""
    out = {}
    for key, value in state_dict.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            base, _, tail = key.partition(".attention.to_q.")
            out[f"{base}.attention.qkv.{tail}"] = torch.cat(
                [state_dict[f"{base}.attention.to_{n}.{tail}"] for n in "qkv"], dim=0)
            continue
        key = native_module_name(key).replace(".attention.norm_q.", ".attention.q_norm.")
        out[key.replace(".attention.norm_k.", ".attention.k_norm.")] = value
    return out


def comfy_lora_pairs(weights: dict[str, torch.Tensor], alpha: float):
    """diffusers-named LoRA weights -> {ComfyUI module: (A, B, alpha)}; q/k/v fused into qkv."""
    pairs = peft_pairs(weights)
    out = {}
    for module, (a, b) in pairs.items():
        if module.endswith((".attention.to_k", ".attention.to_v")):
            continue
        if module.endswith(".attention.to_q"):
            base = module[: -len(".to_q")]
            parts = [pairs.get(f"{base}.{n}") for n in ("to_q", "to_k", "to_v")]
            if any(p is None for p in parts):
                raise ValueError(f"{base}: a ComfyUI LoRA needs all of to_q, to_k and to_v "
                                 "(ComfyUI's Z-Image has one fused qkv Linear)")
            fa, fb = fused_pair(parts, [p[1].shape[0] for p in parts], 1.0)
            out[f"{base}.qkv"] = (fa, fb, alpha * 3)  # alpha / rank stays as it was
        else:
            out[native_module_name(module)] = (a, b, alpha)
    return out
