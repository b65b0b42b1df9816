"""Krea 2: Krea2Transformer2DModel + AutoencoderKLQwenImage + Qwen3-VL text encoder.

Loads the diffusers folder layout `Krea2Pipeline.save_pretrained` writes. Prompts go through the
pipeline's own `encode_prompt`: the Qwen-Image template padded to a fixed length in the middle
([prefix | prompt | PAD | suffix], the 34 prefix tokens dropped) and the stack of the
`text_encoder_select_layers` hidden states per token, cached as they are with the pipeline's mask.

Conventions, from `Krea2Pipeline.__call__`: latents are normalised per channel with the VAE's
latents_mean / latents_std (the pipeline decodes `x * std + mean`) and packed in 2x2 patches;
the transformer gets sigma in [0, 1] (t / 1000) and predicts the flow velocity noise - x0, which
the Euler flow-matching scheduler steps with (dpipe's default objective).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.loss import weighted_mean
from dpipe.errors import ModelLoadError
from dpipe.models.common.latent_packing import pack
from dpipe.models.diffusers_folder import check_folder, load_denoiser, load_encoders, read_json
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.krea2.layers import Krea2Block, Krea2Embed, krea2_layers
from dpipe.models.krea2.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, peft_to_diffusers, save_diffusers_lora, write_lora_files)
from dpipe.models.spec import (
    EDGE_LAYER_TIME, ModelSpec, NoisedBatch, PipelineLayer, attention_train_flops, denoiser_config,
    model_params)
from dpipe.models.sync_free import carrier

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer",
                  "scheduler")

# Every Linear of every Krea2TransformerBlock: the gated attention's projections and the SwiGLU.
LORA_TARGETS = (r"transformer_blocks\.\d+\.(?:attn\.(?:to_q|to_k|to_v|to_gate|to_out\.0)"
                r"|ff\.(?:gate|up|down))")


# The embedding layer's time relative to a main block (layer_costs): estimated, not measured.
EMBED_COST = 0.5


class Krea2Spec(ModelSpec):
    family = "krea2"

    def ensure_available(self) -> None:
        if self.cfg.tiny and not self.path.exists():
            from dpipe.models.krea2.tiny import make_tiny_krea2

            make_tiny_krea2(self.path)
        check_folder(self.path, REQUIRED_PARTS, "Krea 2", "a Krea 2 checkpoint converted to "
                     "diffusers")
        if self._index().get("patch_size", 2) != 2:
            raise ModelLoadError(f"{self.path}/model_index.json: patch_size "
                                 f"{self._index()['patch_size']}; dpipe trains Krea 2 with 2x2 "
                                 "patches, as released")
        self._vae_config()

    def _index(self) -> dict[str, Any]:
        return read_json(self.path / "model_index.json")

    def _vae_config(self) -> dict[str, Any]:
        return read_json(self.path / "vae" / "config.json")

    @property
    def pixel_multiple(self) -> int:
        # The pipeline's vae_scale_factor 2 ** len(temperal_downsample) (8 for the real VAE) x 2.
        return 2 ** len(self._vae_config()["temperal_downsample"]) * 2

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import Krea2Pipeline

        return load_encoders(Krea2Pipeline, self.path, device, dtype,
                             frozen=("vae", "text_encoder"))

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        from diffusers import Krea2Transformer2DModel

        return load_denoiser(Krea2Transformer2DModel, self.path, None, dtype)

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "image":
            vae = self._vae_config()
            return {"family": self.family, "vae": folder_fingerprint(self.path / "vae"),
                    "latents_mean": vae.get("latents_mean"),
                    "latents_std": vae.get("latents_std"), "latent": "mode"}
        return {
            "family": self.family,
            "text_encoder": folder_fingerprint(self.path / "text_encoder"),
            "tokenizer": folder_fingerprint(self.path / "tokenizer"),
            "select_layers": self._index().get("text_encoder_select_layers"),
            "max_text_tokens": self.cfg.max_text_tokens,
            "layout": "pipeline encode_prompt: fixed length, tapped layers stacked, mask",
        }

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        vae = encoders.vae
        # A video VAE: one frame. Normalised as the pipeline un-normalises before decoding.
        latents = vae.encode(pixels.to(vae.device, vae.dtype)[:, :, None]).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
        return ((latents - mean.to(latents.dtype)) / std.to(latents.dtype))[:, :, 0]

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        # Every prompt encodes to exactly max_text_tokens (the pipeline's fixed-length block),
        # so the cache keeps the pipeline's tensors as they are.
        embeds, mask = encoders.encode_prompt(
            list(prompts), device=encoders.vae.device,
            max_sequence_length=self.cfg.max_text_tokens)
        return {"text": embeds, "text_mask": mask.float()}

    # ---- training ----------------------------------------------------------------------------
    def lora_targets(self) -> str:
        return LORA_TARGETS

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return krea2_layers(denoiser)

    def pipeline_layer_count(self) -> int:
        """krea2_layers: the embedding, every block, the head."""
        blocks, = denoiser_config(self.path / "transformer", "Krea2Transformer2DModel",
                                  "num_layers")
        return 2 + blocks

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """A block 1, the head EDGE_LAYER_TIME, the embedding EMBED_COST: its text fusion runs
        4 blocks of the text width (2560), two of them over 12 tapped layers x 512 tokens, about
        half a main block's FLOPs at 1024x1024 (parameter counts would put it on a stage alone
        in the tiny model, whose text fusion outweighs its blocks)."""
        return [EMBED_COST if isinstance(layer, Krea2Embed) else
                1.0 if isinstance(layer, Krea2Block) else EDGE_LAYER_TIME for layer in layers]

    def make_inputs(self, batch: NoisedBatch):
        _, _, h, w = batch.latents.shape
        text = batch.text
        inputs = (pack(batch.noisy), batch.timesteps, text["text"],
                  text["text_mask"].round().long(), carrier(h // 2, w // 2))
        return inputs, self._labels(batch)

    def _labels(self, batch) -> tuple[torch.Tensor, ...]:
        b, c, h, w = batch.latents.shape
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        if weight is None:
            return (pack(batch.target),)
        return pack(batch.target), pack(weight.expand(b, 1, h, w)).repeat(1, 1, c)

    def loss(self, outputs, labels) -> torch.Tensor:
        return weighted_mean(self.element_error(outputs, labels[0]), *labels[1:])

    # ---- export ------------------------------------------------------------------------------
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        from diffusers import Krea2Pipeline

        weights = peft_to_diffusers(state_dict)
        # The diffusers file only: no ComfyUI format is established for Krea 2 (docs/models/krea2.md).
        return write_lora_files(
            out_dir, lambda: save_diffusers_lora(Krea2Pipeline, weights, metadata, out_dir), [])

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        from dpipe.models.diffusers_folder import write_transformer_folder

        return write_transformer_folder(shards, out_dir, self.path)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        from diffusers import Krea2Pipeline

        from dpipe.models.sync_free import sizes

        image, t, text, text_mask, grid = inputs
        h, w = sizes(grid)
        ids = Krea2Pipeline.prepare_position_ids(text.shape[1], h, w, image.device)
        return denoiser(hidden_states=image, encoder_hidden_states=text, timestep=t,
                        position_ids=ids, encoder_attention_mask=text_mask.bool(),
                        return_dict=False)[0]

    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        from diffusers import Krea2Pipeline

        pipe = Krea2Pipeline.from_pretrained(self.path, text_encoder=None, vae=None,
                                             tokenizer=None,
                                             transformer=self.load_denoiser(torch.float32))
        pipe.load_lora_weights(str(lora_dir), weight_name=DIFFUSERS_LORA)
        return pipe.transformer

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        from diffusers import Krea2Transformer2DModel

        return Krea2Transformer2DModel.from_pretrained(export_dir / "transformer")

    # ---- sampling ---------------------------------------------------------------------------
    def sampling(self):
        from dpipe.models.krea2.sampling import Krea2Sampling

        return Krea2Sampling(self)

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        n, valid = shapes["text"][0], shapes["valid"]
        mask = torch.zeros(n)
        mask[:valid] = 1.0
        return torch.randn(shapes["latents"]), {"text": torch.randn(shapes["text"]),
                                                "text_mask": mask}

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        """6 (full) or 4 (LoRA) x parameters x joint tokens, plus the blocks' attention. The
        text fusion's parameters are counted over the joint tokens too: an overcount of its
        share (it runs over text only, its layerwise blocks over text x tapped layers)."""
        image, _t, text = inputs[:3]
        c = denoiser.config
        seq = image.shape[1] + text.shape[1]
        width = c.num_attention_heads * c.attention_head_dim
        attention = attention_train_flops(seq, width) * c.num_layers
        return image.shape[0] * ((6 if full else 4) * model_params(denoiser) * seq + attention)

