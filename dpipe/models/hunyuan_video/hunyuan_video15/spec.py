"""HunyuanVideo 1.5 (8.3B, text-to-video): HunyuanVideo15Transformer3DModel +
AutoencoderKLHunyuanVideo15 (32 channels, 16x spatial, 4x temporal) + Qwen2.5-VL-7B text +
ByT5 glyph text.

Loads the diffusers folder (hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v or 720p_t2v), or a
single-file transformer in Tencent's original / ComfyUI layout (model.path=<file>.safetensors, with
that folder as model.single_file_config for the rest; see original.py). Prompts
go through `HunyuanVideo15Pipeline.encode_prompt` (chat template, quoted text to ByT5). The
transformer takes [noisy latents, condition latents, condition mask] on its channels; for
text-to-video the pipeline passes zeros for both, and all-zero SigLIP image tokens: so do we.
Images train as 1-frame videos; clips need 4k+1 frames.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.loss import weighted_labels
from dpipe.errors import ModelLoadError
from dpipe.models.adapters import is_adapter_param
from dpipe.models.attention_mask import (
    joint_padding_mask, real_tokens, trim_or_drop, trim_text_padding)
from dpipe.models.comfyui import COMFY_PREFIX
from dpipe.models.common.shapes import causal_clips
from dpipe.models.hunyuan_video.hunyuan_video15.layers import IMAGE_TOKENS, hunyuan_video15_layers
from dpipe.models.hunyuan_video.hunyuan_video15.original import (
    comfyui_mapping, file_form, from_original, original_state_dict)
from dpipe.models.hunyuan_video.hunyuan_video15.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.hunyuan_video.family import HunyuanVideoFamily
from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.single_file import export_like_source
from dpipe.models.spec import NoisedBatch, attention_train_flops

COMFYUI_LORA = "hunyuan_video15_lora_comfyui.safetensors"
ENCODING_VERSION = 1
BYT5_TOKENS = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length
# A typical training clip (480p, 121 frames: 31 x 30 x 53 latent tokens), for `layer_costs`.
NOMINAL_VIDEO_TOKENS = 31 * 30 * 53

# Every Linear of the double-stream blocks (attention, MLPs, modulation).
_BLOCK_LINEARS = [
    r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
    r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
    r"ff\.net\.0\.proj", r"ff\.net\.2", r"ff_context\.net\.0\.proj", r"ff_context\.net\.2",
    r"norm1\.linear", r"norm1_context\.linear",
]
LORA_TARGETS = r"transformer_blocks\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"


class HunyuanVideo15Spec(HunyuanVideoFamily):
    family = "hunyuan_video15"
    title, example = "HunyuanVideo 1.5", "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v"
    pipeline_class = "HunyuanVideo15Pipeline"
    denoiser_class = "HunyuanVideo15Transformer3DModel"
    text_fingerprint = {"qwen": "text_encoder", "byt5": "text_encoder_2",
                        "tokenizers": ("tokenizer", "tokenizer_2")}
    text_notes = {"encoding": ENCODING_VERSION}
    image_notes = {"encoding": ENCODING_VERSION, "latent": "mode"}
    tiny_writer = "dpipe.models.hunyuan_video.hunyuan_video15.tiny:make_tiny_hunyuan_video15"
    lora_modules = LORA_TARGETS
    layers = hunyuan_video15_layers  # the embedding, every block, the head
    sampler = "dpipe.models.hunyuan_video.hunyuan_video15.sampling:HunyuanVideo15Sampling"
    # HunyuanVideo15Pipeline has no LoRA loader mixin; the file is diffusers' standard LoRA
    # layout ("transformer." keys + adapter metadata), written by a mixin that has one, and
    # loads with `HunyuanVideo15Transformer3DModel.load_lora_adapter`.
    lora_writer = "HunyuanVideoPipeline"
    # A single file in Tencent's original / ComfyUI layout (original.py).
    from_single_file = from_original
    # ComfyUI runs HunyuanVideo 1.5 on its HunyuanVideo code, whose double blocks are
    # Flux-style (`img_attn.qkv` (q, k, v fused), `img_attn.proj`, `img_mlp.0` / `.2`,
    # `img_mod.lin` and the same for `txt_`) and whose other modules are the original ones under
    # its renames (the token refiner's `self_attn.qkv`, the embedder MLPs' `in_layer` /
    # `out_layer`); its LoRA loader accepts `diffusion_model.<those names>`. The names come from
    # the one table of original.py, which also maps the single-file weights.
    comfyui_lora, comfyui_mapping = COMFYUI_LORA, comfyui_mapping

    def read_configs(self) -> None:
        config = self.part_config("transformer")
        if config.get("task_type", "t2v") != "t2v":
            raise ModelLoadError(
                f"{self.path / 'transformer'} is an image-to-video HunyuanVideo 1.5 (task_type="
                f"{config.get('task_type')!r}); dpipe trains the text-to-video checkpoints")
        self.part_config("vae")

    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        pipe = super().load_encoders(device, dtype)
        # The pipeline crops its chat template at a fixed 108 tokens (the real Qwen2.5-VL
        # tokenizer's count); count it with the tokenizer at hand, and pad to max_text_tokens.
        pipe.prompt_template_encode_start_idx = template_length(pipe.tokenizer, pipe.system_message)
        pipe.tokenizer_max_length = self.cfg.max_text_tokens
        return pipe

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) or (B, 3, F, H, W) in [-1, 1] -> (B, C, f, h, w), scaled as the pipeline
        scales image latents."""
        video = causal_clips(pixels, self.temporal_ratio, self.title)
        vae = encoders.vae
        # One clip at a time: the VAE's mid-block attention mask breaks batches > 1 in diffusers
        # 0.42.1 (a missing unsqueeze; diffusers PR #13133).
        latents = torch.cat([vae.encode(clip[None].to(vae.device, vae.dtype)).latent_dist.mode()
                             for clip in video])
        return latents * vae.config.scaling_factor

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        text, mask, glyph, glyph_mask = encoders.encode_prompt(
            prompts, device=encoders.vae.device, batch_size=len(prompts))
        return {"qwen": text, "mask": mask.long(), "byt5": glyph, "byt5_mask": glyph_mask.long()}

    # ---- training ----------------------------------------------------------------------------
    def layer_costs(self, layers) -> list[float]:
        """Parameters x the tokens they process in a typical clip (`token_weighted_params`)."""
        return [token_weighted_params(layer.named_parameters(), NOMINAL_VIDEO_TOKENS,
                                      self.cfg.max_text_tokens, BYT5_TOKENS, IMAGE_TOKENS)
                for layer in layers]

    def make_inputs(self, batch: NoisedBatch):
        noisy = batch.noisy
        b, _, f, h, w = noisy.shape
        # Text-to-video: no condition latents and a zero condition mask, as the pipeline passes.
        x = torch.cat([noisy, torch.zeros_like(noisy), noisy.new_zeros(b, 1, f, h, w)], dim=1)
        # Each text stream cut after its longest prompt, and the joint text's mask, on the CPU
        # (dpipe.models.attention_mask): at one prompt per micro-batch nothing is left to mask.
        text, mask = trim_text_padding(batch.text["qwen"], batch.text["mask"])
        glyph, glyph_mask = trim_or_drop(batch.text["byt5"], batch.text["byt5_mask"])
        joint = joint_padding_mask((glyph, glyph_mask), (text, mask))
        inputs = (x, batch.timesteps, text, mask.long(), glyph, glyph_mask.long(), joint)
        return inputs, weighted_labels(batch)

    # ---- export ------------------------------------------------------------------------------
    def export_single_file(self, folder: Path, out_dir: Path) -> Path:
        # Back in the form of the source file (Tencent's split one, Comfy-Org's fused one), so
        # the tool that loaded the source loads the fine-tune.
        return export_like_source(
            folder, self.single_file,
            lambda weights: original_state_dict(weights, form=self._source_form()), out_dir)

    def _source_form(self) -> str:
        from safetensors import safe_open

        with safe_open(self.single_file, "pt") as source:
            return file_form([k.removeprefix("model.").removeprefix(COMFY_PREFIX)
                              for k in source.keys()])

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        x, t, text, mask, glyph, glyph_mask, _joint = inputs
        # diffusers takes masks of the texts' lengths.
        mask, glyph_mask = real_tokens(mask, text).long(), real_tokens(glyph_mask, glyph).long()
        image = x.new_zeros(x.shape[0], IMAGE_TOKENS, denoiser.config.image_embed_dim)
        return denoiser(
            hidden_states=x, image_embeds=image, timestep=t * 1000, encoder_hidden_states=text,
            encoder_attention_mask=mask, encoder_hidden_states_2=glyph,
            encoder_attention_mask_2=glyph_mask, return_dict=False)[0]

    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        # The pipeline has no LoRA loader: the transformer loads it (from a single file, the
        # base transformer is that file's, as the user loads it).
        model = self.load_denoiser(torch.float32)
        model.load_lora_adapter(str(lora_dir), weight_name=DIFFUSERS_LORA, prefix="transformer")
        return model

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        mask = torch.zeros(shapes["qwen"][0], dtype=torch.long)
        mask[:shapes["text_tokens"]] = 1
        text = {"qwen": torch.randn(shapes["qwen"]), "mask": mask,
                "byt5": torch.randn(shapes["byt5"]),
                "byt5_mask": torch.zeros(shapes["byt5"][0], dtype=torch.long)}
        return torch.randn(shapes["latents"]), text

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        x, _t, text, _mask, glyph = inputs[:5]
        b, _, f, h, w = x.shape
        # The video and the (cut) text streams; text-to-video drops the image tokens (layers.py).
        video, text_tokens, glyph_tokens = f * h * w, text.shape[1], glyph.shape[1]
        weights = token_weighted_params(denoiser.named_parameters(), video, text_tokens,
                                        glyph_tokens, 0)
        c = denoiser.config
        attention = c.num_layers * attention_train_flops(
            video + text_tokens + glyph_tokens, c.num_attention_heads * c.attention_head_dim)
        return b * ((6 if full else 4) * weights + attention)


def token_weighted_params(named_parameters, video_tokens: int, text_tokens: int,
                          glyph_tokens: int, image_tokens: int) -> float:
    """Sum of parameters x the tokens each processes, in a layer's or the transformer's names
    (LoRA adapters left out): the text-only embedders (the ByT5 projection alone is a 2048-wide
    MLP) weigh by their few tokens, not their size; the blocks see every token."""
    joint_text = text_tokens + glyph_tokens + image_tokens
    per_module = {"context_embedder": text_tokens, "context_embedder_2": glyph_tokens,
                  "image_embedder": image_tokens, "time_embed": 1, "cond_type_embed": joint_text,
                  "block": video_tokens + joint_text,
                  "transformer_blocks": video_tokens + joint_text}
    return float(sum(param.numel() * per_module.get(name.split(".")[0], video_tokens)
                     for name, param in named_parameters if not is_adapter_param(name)))


def template_length(tokenizer, system_message: str) -> int:
    """Tokens of HunyuanVideo15Pipeline's chat template before the user's prompt (108 with the
    real Qwen2.5-VL tokenizer)."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    marker = "\x00PROMPT\x00"
    text = tokenizer.apply_chat_template(format_text_input([marker], system_message),
                                         add_generation_prompt=True, tokenize=False)
    text = text[0] if isinstance(text, list) else text
    return len(tokenizer(text.split(marker)[0], add_special_tokens=False).input_ids)

