"""Lumina-Image 2.0: Lumina2Transformer2DModel + AutoencoderKL (FLUX's VAE) + Gemma-2 2B.

Loads the diffusers folder layout of Alpha-VLLM/Lumina-Image-2.0. Prompts go through diffusers'
own `Lumina2Pipeline.encode_prompt`: the system prompt, " <Prompt Start> ", the caption; Gemma's
second-to-last hidden state padded to `model.max_text_tokens` (256 in the pipeline) with its mask.

Conventions of the family, from `Lumina2Pipeline.__call__`: the transformer gets
t_model = 1 - sigma (1 = clean image) and predicts x0 - noise (the pipeline steps with -output).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.flow_matching import noisy_latents, velocity_target
from dpipe.diffusion.loss import weighted_labels, weighted_mean
from dpipe.models.common.lumina_layers import lumina_inputs, lumina_layer_count
from dpipe.models.comfyui import comfy_lora_tensors, fused_pair, peft_pairs
from dpipe.models.diffusers_folder import (
    check_folder, kl_image_fingerprint, kl_latents, load_denoiser, load_encoders, read_json)
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, LoraFormat, peft_to_diffusers, save_diffusers_lora,
    write_lora_files)
from dpipe.models.lumina2.layers import lumina2_layers
from dpipe.models.lumina2.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.refined_joint import (
    NOMINAL_IMAGE_TOKENS, layer_forward_flops, refined_joint_train_flops)
from dpipe.models.single_file import check_single_file, split_path
from dpipe.models.spec import ModelSpec, NoisedBatch, PipelineLayer

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer")

# Every Linear of every Lumina2TransformerBlock (main layers and both refiners): attention, the
# SwiGLU MLP and the adaLN modulation (norm1.linear; the context refiner has none).
_BLOCK_LINEARS = [r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
                  r"feed_forward\.linear_1", r"feed_forward\.linear_2", r"feed_forward\.linear_3",
                  r"norm1\.linear"]
LORA_TARGETS = r"(?:layers|noise_refiner|context_refiner)\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"

# Weights that see one token per sample (the timestep embedder, the modulations of the blocks
# and of the head's norm), and the embedder's that see the caption's (layer_costs).
PER_SAMPLE_WEIGHTS = ("timestep_embedder", "norm1.linear", "norm_out.linear_1")
TEXT_WEIGHTS = ("caption_embedder",)
COMFY_LORA = "comfyui_lora.safetensors"


class Lumina2Spec(ModelSpec):
    family = "lumina2"

    def __init__(self, cfg):
        super().__init__(cfg)
        # model.path: the diffusers folder, or a single-file transformer (ComfyUI's / the original
        # layout) with model.single_file_config naming the diffusers folder for the rest.
        self.path, self.single_file = split_path(cfg)

    def ensure_available(self) -> None:
        if self.cfg.tiny and not self.path.exists():
            from dpipe.models.lumina2.tiny import make_tiny_lumina2

            make_tiny_lumina2(self.path)
        check_folder(self.path, REQUIRED_PARTS, "Lumina-Image 2.0", "Alpha-VLLM/Lumina-Image-2.0")
        check_single_file(self.single_file)
        self._vae_config()

    def _vae_config(self) -> dict[str, Any]:
        return read_json(self.path / "vae" / "config.json")

    @property
    def pixel_multiple(self) -> int:
        # Lumina2Pipeline assumes an 8x VAE whatever the VAE says; then 2x2 patches.
        patch = read_json(self.path / "transformer" / "config.json").get("patch_size", 2)
        return 8 * patch

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import Lumina2Pipeline

        return load_encoders(Lumina2Pipeline, self.path, device, dtype,
                             frozen=("vae", "text_encoder"))

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        from diffusers import Lumina2Transformer2DModel

        # A single file: not read by diffusers' from_single_file, whose converter splits qkv at
        # the 2B model's sizes only.
        return load_denoiser(Lumina2Transformer2DModel, self.path, self.single_file, dtype,
                             convert=from_native)

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "image":
            return kl_image_fingerprint(self.family, self.path)
        return {
            "family": self.family,
            "text_encoder": folder_fingerprint(self.path / "text_encoder"),
            "tokenizer": folder_fingerprint(self.path / "tokenizer"),
            "max_text_tokens": self.cfg.max_text_tokens,
            "layout": "pipeline system prompt, hidden_states[-2], padded + mask",
        }

    # ---- caching -----------------------------------------------------------------------------
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        return kl_latents(encoders.vae, pixels)

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask, _, _ = encoders.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, device=encoders.vae.device,
            max_sequence_length=self.cfg.max_text_tokens)
        return {"cap": embeds, "cap_mask": mask.float()}

    # Lumina2Pipeline puts its system prompt before the prompt, not before the negative prompt.
    negative_prompts_differ = True

    @torch.no_grad()
    def encode_negative_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        _, _, embeds, mask = encoders.encode_prompt(
            list(prompts), negative_prompt=list(prompts), do_classifier_free_guidance=True,
            device=encoders.vae.device, max_sequence_length=self.cfg.max_text_tokens)
        return {"cap": embeds, "cap_mask": mask.float()}

    # ---- training ----------------------------------------------------------------------------
    def lora_targets(self) -> str:
        return LORA_TARGETS

    def noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
        # Lumina 2 predicts x0 - noise (the pipeline negates its output before stepping).
        return noisy_latents(x0, noise, t), -velocity_target(x0, noise)

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return lumina2_layers(denoiser)

    def pipeline_layer_count(self) -> int:
        return lumina_layer_count(self.path / "transformer", "Lumina2Transformer2DModel")

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """Forward FLOPs per layer at a 1024x1024 image and the longest caption
        (`dpipe.models.refined_joint`): the caption refiners run a block's weights over the
        caption alone, the timestep embedder and the modulations once per sample."""
        return layer_forward_flops(layers, NOMINAL_IMAGE_TOKENS, self.cfg.max_text_tokens,
                                   per_sample=PER_SAMPLE_WEIGHTS, text_weights=TEXT_WEIGHTS)

    def make_inputs(self, batch: NoisedBatch):
        return lumina_inputs(batch), weighted_labels(batch)

    def loss(self, outputs, labels) -> torch.Tensor:
        return weighted_mean(self.element_error(outputs, labels[0]), *labels[1:])

    # ---- export ------------------------------------------------------------------------------
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        from diffusers import Lumina2Pipeline

        weights = peft_to_diffusers(state_dict)
        return write_lora_files(
            out_dir, lambda: save_diffusers_lora(Lumina2Pipeline, weights, metadata, out_dir),
            [LoraFormat(COMFY_LORA, lambda: comfy_lora_tensors(
                comfy_lora_pairs(weights, metadata["lora_alpha"])), {"format": "pt"})])

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        from dpipe.models.diffusers_folder import write_transformer_folder

        return write_transformer_folder(shards, out_dir, self.path)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, t_model, cap, cap_len, _cap_mask = inputs
        mask = torch.arange(cap.shape[1])[None, :] < cap_len[:, None]
        return denoiser(latents, t_model, cap, mask, return_dict=False)[0]

    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        from diffusers import Lumina2Pipeline

        pipe = Lumina2Pipeline.from_pretrained(self.path, text_encoder=None, vae=None,
                                               tokenizer=None,
                                               transformer=self.load_denoiser(torch.float32))
        pipe.load_lora_weights(str(lora_dir), weight_name=DIFFUSERS_LORA)
        return pipe.transformer

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        from diffusers import Lumina2Transformer2DModel

        return Lumina2Transformer2DModel.from_pretrained(export_dir / "transformer")

    def sampling(self):
        from dpipe.models.lumina2.sampling import Lumina2Sampling

        return Lumina2Sampling(self)

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        mask = torch.zeros(shapes["cap"][0])
        mask[:shapes["text_tokens"]] = 1.0
        return torch.randn(shapes["latents"]), {"cap": torch.randn(shapes["cap"]),
                                                "cap_mask": mask}

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        latents, _t, cap = inputs[:3]
        b, _, h, w = latents.shape
        p = denoiser.config.patch_size
        return refined_joint_train_flops(denoiser, b, (h // p) * (w // p), cap.shape[1],
                                         denoiser.config.hidden_size,
                                         denoiser.time_caption_embed.timestep_embedder, full)


# ---- ComfyUI ------------------------------------------------------------------------------------
# ComfyUI runs Lumina 2 with the original checkpoint's names (diffusers'
# `convert_lumina2_to_diffusers` maps them the other way): attention.qkv (fused), attention.out,
# feed_forward.w1/w2/w3, adaLN_modulation.1 for the modulation.
_TO_NATIVE = [(".attn.to_out.0", ".attention.out"), (".feed_forward.linear_1", ".feed_forward.w1"),
              (".feed_forward.linear_2", ".feed_forward.w2"),
              (".feed_forward.linear_3", ".feed_forward.w3"), (".norm1.linear", ".adaLN_modulation.1")]


def native_module_name(name: str) -> str:
    for diffusers_name, native in _TO_NATIVE:
        name = name.replace(diffusers_name, native)
    return name


_TO_NATIVE_WEIGHTS = [
    ("time_caption_embed.caption_embedder", "cap_embedder"),
    ("time_caption_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
    ("time_caption_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
    ("norm_out.linear_1", "final_layer.adaLN_modulation.1"), ("norm_out.linear_2", "final_layer.linear"),
    (".norm1.norm.", ".attention_norm1."), (".norm2.", ".attention_norm2."),
    (".attn.norm_q.", ".attention.q_norm."), (".attn.norm_k.", ".attention.k_norm."),
]


def native_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Lumina2Transformer2DModel state dict under the original (ComfyUI) names: the
    inverse of diffusers' `convert_lumina2_to_diffusers` (q/k/v fused into attention.qkv)."""
    out = {}
    for key, value in state_dict.items():
        if ".attn.to_k." in key or ".attn.to_v." in key:
            continue
        if ".attn.to_q." in key:
            base, _, tail = key.partition(".attn.to_q.")
            out[f"{base}.attention.qkv.{tail}"] = torch.cat(
                [state_dict[f"{base}.attn.to_{n}.{tail}"] for n in "qkv"], dim=0)
            continue
        if key.startswith("context_refiner.") and ".norm1." in key:
            key = key.replace(".norm1.", ".attention_norm1.")  # no modulation: a plain RMSNorm
        for diffusers_name, native in _TO_NATIVE_WEIGHTS:
            key = key.replace(diffusers_name, native)
        out[native_module_name(key)] = value
    return out


def from_native(native: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Original/ComfyUI-named weights -> `model`'s diffusers names: qkv split at the model's own
    sizes here, every other name by diffusers' `convert_lumina2_to_diffusers`."""
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    native = {k.removeprefix("model.").removeprefix("diffusion_model."): v
              for k, v in native.items() if k != "norm_final.weight"}  # unused in the original
    out = {}
    for key in [k for k in native if ".attention.qkv." in k]:
        base = key.split(".attention.qkv.")[0]
        attn = model.get_submodule(base).attn
        sizes = [attn.to_q.out_features, attn.to_k.out_features, attn.to_v.out_features]
        for name, part in zip(("to_q", "to_k", "to_v"), native.pop(key).split(sizes, dim=0)):
            out[f"{base}.attn.{name}.weight"] = part
    out.update(convert_lumina2_to_diffusers(native))
    return out


def comfy_lora_pairs(weights: dict[str, torch.Tensor], alpha: float):
    """diffusers-named LoRA weights -> {ComfyUI module: (A, B, alpha)}; q/k/v fused into qkv."""
    pairs = peft_pairs(weights)
    out = {}
    for module, (a, b) in pairs.items():
        if module.endswith((".attn.to_k", ".attn.to_v")):
            continue
        if module.endswith(".attn.to_q"):
            base = module[: -len(".attn.to_q")]
            parts = [pairs.get(f"{base}.attn.{n}") for n in ("to_q", "to_k", "to_v")]
            if any(p is None for p in parts):
                raise ValueError(f"{base}: a ComfyUI LoRA needs all of to_q, to_k and to_v "
                                 "(ComfyUI's Lumina 2 has one fused qkv Linear)")
            fa, fb = fused_pair(parts, [p[1].shape[0] for p in parts], 1.0)
            out[f"{base}.attention.qkv"] = (fa, fb, alpha * 3)  # alpha / rank unchanged
        else:
            out[native_module_name(module)] = (a, b, alpha)
    return out
