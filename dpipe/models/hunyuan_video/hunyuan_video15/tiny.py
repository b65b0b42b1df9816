"""A tiny random HunyuanVideo 1.5 (text-to-video), in the diffusers layout of
hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v.

The real folder: model_index.json (HunyuanVideo15Pipeline), scheduler/ (flow matching, shift 5),
transformer/ (HunyuanVideo15Transformer3DModel, task_type t2v, 65 = 2*32+1 input channels: noisy
latents, condition latents, condition mask), vae/ (AutoencoderKLHunyuanVideo15, 16x spatial, 4x
temporal, 32 channels), text_encoder/ (Qwen2_5_VLTextModel) + tokenizer/ (Qwen2Tokenizer with its
chat template), text_encoder_2/ (the Glyph ByT5 T5EncoderModel) + tokenizer_2/ (ByT5Tokenizer) and
guider/ (ClassifierFreeGuidance). Only the sizes shrink.

Sizes: 64x64 images (or 4k+1 frames) -> VAE (8x spatial, 4x temporal, 4 channels) -> 8x8 latents
per latent frame -> 64 tokens of width 32. Qwen2.5-VL text: hidden 32, 3 layers (the pipeline
reads the third-from-last hidden state); ByT5: d_model 24.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_files import save_parts, save_sharded
from dpipe.models.hunyuan_video.hunyuan_video15.sizes import (
    BYT5_DIM, HUNYUAN_VIDEO15_TINY, LATENT_CHANNELS, TEXT_DIM)
from dpipe.models.tiny_parts import save_model_index, seeded, tiny_t5_encoder, tiny_writer


@tiny_writer
def make_tiny_hunyuan_video15(out: Path, seed: int) -> None:
    """A tiny random HunyuanVideo 1.5 t2v diffusers folder."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)
    from transformers import (
        ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, Qwen2Tokenizer)

    from dpipe.models.common.tiny_qwen_tokenizer import save_qwen_tokenizer

    added = save_qwen_tokenizer(out / "tokenizer", "qwen2.5-vl")
    ByT5Tokenizer().save_pretrained(out / "tokenizer_2")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    guider = ClassifierFreeGuidance(guidance_scale=6.0)

    with seeded(seed):
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=round_up(max(added.values()) + 1, 128), hidden_size=TEXT_DIM,
            intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                             "mrope_section": [2, 3, 3]},  # sums to head_dim / 2, as [16, 24, 24]
            tie_word_embeddings=False, bos_token_id=added["<|endoftext|>"],
            eos_token_id=added["<|im_end|>"]))
    with seeded(seed + 1):
        text_encoder_2 = tiny_t5_encoder(384, BYT5_DIM, 48, d_kv=12)  # ByT5's 384 ids
    with seeded(seed + 2):
        transformer = HunyuanVideo15Transformer3DModel.from_config(HUNYUAN_VIDEO15_TINY)
    with seeded(seed + 3):
        vae = AutoencoderKLHunyuanVideo15(
            in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
            # Four levels: 8x spatial (the real VAE: five levels, 16x); 4x temporal as the real one.
            block_out_channels=(8, 16, 16, 16), layers_per_block=1, spatial_compression_ratio=8,
            temporal_compression_ratio=4, scaling_factor=1.03682)

    guider.save_pretrained(out / "guider")
    save_parts(out, save_sharded, torch.bfloat16, scheduler, transformer=(transformer, 2),
               text_encoder=(text_encoder, 2), text_encoder_2=(text_encoder_2, 1), vae=(vae, 1))

    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=Qwen2Tokenizer.from_pretrained(out / "tokenizer"),
        transformer=transformer, vae=vae, scheduler=scheduler, text_encoder_2=text_encoder_2,
        tokenizer_2=ByT5Tokenizer.from_pretrained(out / "tokenizer_2"), guider=guider)
    index = save_model_index(pipe, out)
    assert index["tokenizer"] == ["transformers", "Qwen2Tokenizer"], index


def write_single_file(folder: Path, file: Path, prefix: str = "", form: str = "fused") -> Path:
    """The transformer of the tiny folder at `folder` as one file in Tencent's original layout,
    keys behind `prefix` ("model.diffusion_model." as ComfyUI saves models). `form` "fused": q, k,
    v in `double_blocks.N.img_attn_qkv`, as hunyuanvideo1.5_720p_t2v_fp16.safetensors holds them
    and ComfyUI loads them; "split": `img_attn_q/_k/_v`, as Tencent releases it (see original.py).
    Stored in the folder's dtype, not the real file's fp16, so that loading it can be compared bit
    for bit."""
    from dpipe.models.hunyuan_video.hunyuan_video15.original import original_state_dict
    from dpipe.models.single_file import write_transformer_file

    config = json.loads((Path(folder) / "transformer" / "config.json").read_text())
    return write_transformer_file(Path(folder) / "transformer", file,
                                  lambda weights: original_state_dict(weights, config, form),
                                  prefix)
