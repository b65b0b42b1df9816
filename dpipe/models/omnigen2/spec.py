"""OmniGen2: dpipe's OmniGen2Transformer2DModel + AutoencoderKL (FLUX's VAE) + Qwen2.5-VL-3B.

Loads the folder layout of OmniGen2/OmniGen2 (model_index.json, transformer/, vae/, mllm/,
processor/, scheduler/), as the reference's `OmniGen2Pipeline.from_pretrained` reads it
(VectorSpaceLab/OmniGen2, commit 0f72fa9). No diffusers class runs it (diffusers 0.42.1 has
OmniGen v1 only): the transformer is `dpipe.models.omnigen2.transformer`, whose weights and config
are the reference's. Text-to-image only: the reference-image path (editing, in-context
generation) is not trained, and its weights leave a full fine-tune as they came.

Prompts as the reference pipeline's `encode_prompt`: a chat turn after the system prompt below,
without a generation prompt; the MLLM's last hidden state (`hidden_states[-1]`) with its mask,
padded on the right to `model.max_text_tokens` (the reference pads to the longest prompt; under
causal attention the real tokens' states are the same). The negative prompt goes through the same
template, so it is cached as a caption is.

Conventions, from the reference's pipeline and scheduler: the transformer gets t in [0, 1] with
1 the clean image (t = 1 - sigma) and predicts the velocity clean - noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.errors import ModelLoadError
from dpipe.models.comfyui import renamed
from dpipe.models.common.lumina import COMFY_LORA, LuminaFamily
from dpipe.models.diffusers_folder import read_json
from dpipe.models.family import diffusers_class
from dpipe.models.lora_files import DIFFUSERS_LORA, LoraFormat, lora_scale
from dpipe.models.omnigen2.layers import omnigen2_layers
from dpipe.models.omnigen2.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.refined_joint import refined_joint_train_flops
from dpipe.models.single_file import load_or_fail

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "mllm", "processor", "scheduler")
TRANSFORMER_CLASS = "OmniGen2Transformer2DModel"
SYSTEM_PROMPT = "You are a helpful assistant that generates high-quality images based on user instructions."

# The weights of the reference-image path, which no text-to-image layer holds (nor the LoRA
# targets: LuminaFamily's, the text-to-image blocks').
REFERENCE_IMAGE_WEIGHTS = ("ref_image_patch_embedder.", "ref_image_refiner.",
                           "image_index_embedding")
# ComfyUI runs OmniGen2 natively (comfy/ldm/omnigen/omnigen2.py) under the reference's module
# names, and its LoRA loader maps "diffusion_model.<module>" onto them.


@dataclass
class OmniGen2Encoders:
    """What caching needs: the VAE, the MLLM and its tokenizer (processor/)."""

    vae: nn.Module
    mllm: nn.Module
    tokenizer: Any


def transformer_class():
    """dpipe's OmniGen2 transformer (imported when needed: it imports diffusers' blocks)."""
    return diffusers_class(OmniGen2Spec.denoiser_class)


class OmniGen2Spec(LuminaFamily):
    family = "omnigen2"
    title, example = "OmniGen2", "OmniGen2/OmniGen2"
    # No diffusers class runs OmniGen2 (so no pipeline_class): the transformer is dpipe's, its
    # config and weights the reference's; the encoders load part by part.
    denoiser_class = f"dpipe.models.omnigen2.transformer:{TRANSFORMER_CLASS}"
    required_parts = REQUIRED_PARTS
    text_fingerprint = {"mllm": "mllm", "processor": "processor"}
    text_notes = {
        "layout": "chat template with the system prompt, hidden_states[-1], right-padded + mask"}
    latent_patch = None  # the transformer's patch_size
    tiny_writer = "dpipe.models.omnigen2.tiny:make_tiny_omnigen2"
    # Lumina 2's loader mixin writes the same LoRA file for a "transformer" component (keys
    # "transformer.<module>.lora_A.weight", peft's adapter config in the metadata), which the
    # reference's OmniGen2Pipeline.load_lora_weights and this transformer's load_lora_adapter read.
    lora_writer = "diffusers.loaders:Lumina2LoraLoaderMixin"
    layers = omnigen2_layers
    sampler = "dpipe.models.omnigen2.sampling:OmniGen2Sampling"

    def read_configs(self) -> None:
        config = self.path / "transformer" / "config.json"
        name = read_json(config).get("_class_name")
        if name != TRANSFORMER_CLASS:
            pipeline = read_json(self.path / "model_index.json").get("_class_name")
            raise ModelLoadError(
                f"model.path={self.path} is not an OmniGen2 folder: {config} names {name!r} "
                f"(model_index.json: {pipeline!r}), not {TRANSFORMER_CLASS!r}; give a download "
                "of OmniGen2/OmniGen2, or the model.family of that model")

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> OmniGen2Encoders:
        from diffusers import AutoencoderKL
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        def load():
            vae = AutoencoderKL.from_pretrained(self.path, subfolder="vae", dtype=dtype)
            mllm = Qwen2_5_VLForConditionalGeneration.from_pretrained(self.path / "mllm",
                                                                      dtype=dtype)
            # Right padding: the reference joins each caption's first cap_len tokens.
            tokenizer = AutoTokenizer.from_pretrained(self.path / "processor",
                                                      padding_side="right")
            return OmniGen2Encoders(vae, mllm, tokenizer)

        encoders = load_or_fail(load, self.path)
        for part in (encoders.vae, encoders.mllm):
            part.to(device).requires_grad_(False).eval()
        return encoders

    # ---- caching -----------------------------------------------------------------------------
    def chat(self, tokenizer, prompt: str) -> str:
        """The reference pipeline's `_apply_chat_template`."""
        turns = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False)

    @torch.no_grad()
    def encode_prompts(self, encoders: OmniGen2Encoders, prompts: list[str]
                       ) -> dict[str, torch.Tensor]:
        tok = encoders.tokenizer
        device = encoders.vae.device
        text = tok([self.chat(tok, p) for p in prompts], padding="max_length",
                   max_length=self.cfg.max_text_tokens, truncation=True, return_tensors="pt")
        ids, mask = text.input_ids.to(device), text.attention_mask.to(device)
        hidden = encoders.mllm(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        return {"cap": hidden, "cap_mask": mask.float()}

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        scale = lora_scale(metadata)
        return [LoraFormat(COMFY_LORA, lambda: renamed(weights, scale), {"format": "pt"})]

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        """The transformer folder in the reference's layout; the reference-image weights, which
        text-to-image training does not use, copied from the base model into one more shard."""
        from safetensors.torch import save_file

        dtype = _shard_dtype(shards[0])
        untouched = {k: v.to(dtype).contiguous()
                     for k, v in _base_tensors(self.path / "transformer",
                                               REFERENCE_IMAGE_WEIGHTS).items()}
        extra = shards[-1].with_name("reference-image.safetensors")
        save_file(untouched, extra)
        return super().export_full([*shards, extra], out_dir)

    # ---- using exported weights ----------------------------------------------------------------
    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        denoiser = self.load_denoiser(torch.float32)
        denoiser.load_lora_adapter(str(lora_dir), weight_name=DIFFUSERS_LORA, prefix="transformer")
        return denoiser

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs, sample_shapes = SIZES, SAMPLE_SHAPES

    def random_denoiser(self, size: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
        config = {k: v for k, v in self.bench_configs[size].items() if k != "_class_name"}
        with torch.device(device):
            model = transformer_class()(**config)
        return model.to(dtype)

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        """`refined_joint_train_flops`, less the reference-image weights, which text-to-image
        never runs."""
        latents, _t, cap = inputs[:3]
        b, _, h, w = latents.shape
        p = denoiser.config.patch_size
        image, text = (h // p) * (w // p), cap.shape[1]
        flops = refined_joint_train_flops(denoiser, b, image, text, denoiser.config.hidden_size,
                                          denoiser.time_caption_embed.timestep_embedder, full)
        unused = sum(p.numel() for name, p in denoiser.named_parameters()
                     if name.startswith(REFERENCE_IMAGE_WEIGHTS))
        return flops - b * (6 if full else 4) * unused * (image + text)


def _base_tensors(folder: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of the model folder's safetensors whose names start with `prefixes`, read
    without loading the rest."""
    from safetensors import safe_open

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(prefixes)})
    return out


def _shard_dtype(shard: Path) -> torch.dtype:
    from safetensors import safe_open

    with safe_open(shard, "pt") as f:
        keys = list(f.keys())
        return f.get_tensor(keys[0]).dtype if keys else torch.float32
