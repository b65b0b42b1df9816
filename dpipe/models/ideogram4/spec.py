"""Ideogram 4: Ideogram4Transformer2DModel (x2) + AutoencoderKLFlux2 + Qwen3-VL text encoder.

Loads the diffusers folder layout of `Ideogram4Pipeline`. Prompts go through the pipeline's own
`encode_prompt`: the Qwen3 chat template, left-padded to max_text_tokens, the 13 tapped Qwen3-VL
layers concatenated per token and zeroed on padding; the cache keeps those text rows with each
prompt's token count, and a batch is cut to its longest prompt (padding sits in its own
attention segment, so it changes no image token). The prompt enhancer is not run.

Conventions, from `Ideogram4Pipeline.__call__`: latents are the VAE's in 2x2 patches, channels
ordered (row, column, channel) as the pipeline unpatches them, normalised with the VAE's
BatchNorm statistics (it decodes `z * sqrt(var + eps) + mean`); the cache holds them as
(4C, h/2, w/2). The transformer gets model time 1 - sigma and predicts x0 - noise (the pipeline
steps with its negation), so the label is minus dpipe's flow target noise - x0. Only the
conditional `transformer` trains; the `unconditional_transformer` of the asymmetric guidance
stays the base one, as the pipeline loads LoRAs into `transformer` alone.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from dpipe.errors import DataError
from dpipe.models.common.vae_batch_norm import normalised_patches
from dpipe.models.family import DiffusersFamily
from dpipe.models.ideogram4.comfyui import lora_to_comfyui
from dpipe.models.ideogram4.layers import Ideogram4Block, ideogram4_layers
from dpipe.models.ideogram4.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.spec import NoisedBatch, joint_attention_train_flops
from dpipe.models.sync_free import carrier, sizes

# Every Linear of every Ideogram4TransformerBlock: attention, the SwiGLU and the AdaLN projection.
LORA_TARGETS = (r"layers\.\d+\.(?:attention\.(?:to_q|to_k|to_v|to_out\.0)"
                r"|feed_forward\.(?:w1|w2|w3)|adaln_modulation)")

COMFYUI_LORA = "ideogram4_lora_comfyui.safetensors"


def to_tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, 4C, h, w) -> (B, h * w, 4C), the pipeline's token order."""
    return x.flatten(2).transpose(1, 2)


def from_tokens(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, h, w)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """VAE latents (B, C, H, W) -> (B, 4C, H/2, W/2), channels (row, column, channel): the
    inverse of the pipeline's unpatching view/permute."""
    b, c, hh, ww = latents.shape
    x = latents.view(b, c, hh // 2, 2, ww // 2, 2).permute(0, 3, 5, 1, 2, 4)
    return x.reshape(b, 4 * c, hh // 2, ww // 2)


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    b, c4, h, w = x.shape
    return x.view(b, 2, 2, c4 // 4, h, w).permute(0, 3, 4, 1, 5, 2).reshape(b, c4 // 4, 2 * h, 2 * w)


def _too_long(tokenizer, prompts: list[str], length: int) -> DataError:
    """The error naming the first of `prompts` that the pipeline's chat template makes longer
    than `length` tokens (the pipeline's own message names no prompt)."""
    for prompt in prompts:
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if tokens > length:
            shown = prompt if len(prompt) <= 80 else prompt[:77] + "..."
            return DataError(
                f"the caption or prompt {shown!r} is {tokens} tokens with Ideogram 4's chat "
                f"template, over model.max_text_tokens={length} (Ideogram4Pipeline refuses "
                "longer prompts): raise model.max_text_tokens (the pipeline's default is 2048) "
                "or shorten it")
    return DataError(f"Ideogram4Pipeline refused a prompt as longer than "
                     f"model.max_text_tokens={length}: raise model.max_text_tokens")


class Ideogram4Spec(DiffusersFamily):
    family = "ideogram4"
    title, example = "Ideogram 4", "ideogram-ai/ideogram-4 in diffusers format"
    pipeline_class, denoiser_class = "Ideogram4Pipeline", "Ideogram4Transformer2DModel"
    required_parts = ("model_index.json", "transformer", "unconditional_transformer", "vae",
                      "text_encoder", "tokenizer", "scheduler")
    # The unconditional transformer of the asymmetric guidance does not train and the prompt
    # enhancer is never run: neither is loaded.
    unused_parts = ("unconditional_transformer", "prompt_enhancer_head")
    text_notes = {"layout": "pipeline encode_prompt: chat template, left-padded, 13 taps + length"}
    image_latents = partial(normalised_patches, patchify=patchify)
    vae_config_keys = ()
    image_notes = {"latent": "mode, 2x2 patches (row, col, channel), BatchNorm-normalised"}
    latent_patch = 2
    tiny_writer = "dpipe.models.ideogram4.tiny:make_tiny_ideogram4"
    lora_modules = LORA_TARGETS
    # The embedding is a few projections (the text one over text tokens only), the head one:
    # each below a block, so every stage gets blocks.
    layers, block_types = ideogram4_layers, (Ideogram4Block,)
    sampler = "dpipe.models.ideogram4.sampling:Ideogram4Sampling"
    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        # The text rows of the pipeline's packed conditioning (a 1x1 grid: the image rows are
        # zeros it appends); a prompt over max_text_tokens is refused, as the pipeline refuses
        # it, but naming the prompt and the key.
        length = self.cfg.max_text_tokens
        try:
            embeds, _pos, _seg, indicator = encoders.encode_prompt(
                list(prompts), grid_h=1, grid_w=1, max_sequence_length=length,
                device=encoders.vae.device)
        except ValueError as err:
            if "exceeds max_sequence_length" not in str(err):
                raise
            raise _too_long(encoders.tokenizer, prompts, length) from None
        lens = (indicator[:, :length] == 3).sum(dim=1, keepdim=True).float()
        return {"text": embeds[:, :length], "text_len": lens}

    # ---- training ----------------------------------------------------------------------------
    def make_inputs(self, batch: NoisedBatch):
        b, c, h, w = batch.latents.shape
        lens = batch.text["text_len"].reshape(-1).round().long()
        # Left-padded: keep the last `longest` slots, on the CPU where batches are made.
        text = batch.text["text"]
        text = text[:, text.shape[1] - max(int(lens.max()), 1):]
        inputs = (to_tokens(batch.noisy), batch.timesteps, text, lens, carrier(h, w))
        target = -to_tokens(batch.target)  # x0 - noise: what the transformer predicts
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        if weight is None:
            return inputs, (target,)
        return inputs, (target, to_tokens(weight.expand(b, c, h, w)))

    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFYUI_LORA, lambda: lora_to_comfyui(weights, lora_scale(metadata)),
                           {"format": "comfyui"})]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        """The transformer called as the pipeline calls it: the packed sequence with zero image
        rows in the text features and zero text rows in the latents, ids from `_prepare_ids`."""
        from diffusers import Ideogram4Pipeline

        image, t, text, lens, grid = inputs
        h, w = sizes(grid)
        b, n, tokens = image.shape[0], image.shape[1], text.shape[1]
        ids = Ideogram4Pipeline._prepare_ids(lens.tolist(), h, w, tokens, image.device)
        z = torch.cat([image.new_zeros(b, tokens, image.shape[2]), image], dim=1)
        features = torch.cat([text, text.new_zeros(b, n, text.shape[2])], dim=1)
        out = denoiser(hidden_states=z, timestep=(1.0 - t).to(image.dtype),
                       encoder_hidden_states=features.to(image.dtype), position_ids=ids[0],
                       segment_ids=ids[1], indicator=ids[2], return_dict=False)[0]
        return out[:, tokens:]

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        text = torch.randn(shapes["text"])
        text[: shapes["text"][0] - shapes["valid"]] = 0.0  # left padding, zeroed
        return torch.randn(shapes["latents"]), {
            "text": text, "text_len": torch.tensor([float(shapes["valid"])])}

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        """6 (full) or 4 (LoRA) x parameters x packed tokens, plus the blocks' attention: an
        overcount of the text projection, which runs over the text tokens only."""
        image, _t, text = inputs[:3]
        return joint_attention_train_flops(denoiser, image.shape[0],
                                           image.shape[1] + text.shape[1], full)
