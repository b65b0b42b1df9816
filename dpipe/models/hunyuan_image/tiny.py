"""A tiny random HunyuanImage 2.1, written in the layout of
hunyuanvideo-community/HunyuanImage-2.1-Diffusers.

The real repo: `HunyuanImagePipeline` in model_index.json, a FlowMatchEulerDiscreteScheduler, the
`HunyuanImageTransformer2DModel` (20 dual-stream + 40 single-stream blocks, 2 token-refiner blocks,
patch 1, 64 latent channels, a ByT5 projection for glyph text), `AutoencoderKLHunyuanImage` (32x
spatial compression, 64 channels, scale 0.75289, no shift), Qwen2.5-VL-7B-Instruct as
`Qwen2_5_VLForConditionalGeneration` with its `Qwen2Tokenizer`, and a ByT5 glyph encoder
(`T5EncoderModel` + `ByT5Tokenizer`), plus the guider configs (adaptive projected guidance).

The tiny Qwen tokenizer is learnt on the test captions plus the pipeline's system prompt, so that
prompt's words are single tokens and its prefix is 34 tokens long, as with the real tokenizer: the
pipeline cuts exactly 34 tokens off the front (`prompt_template_encode_start_idx`).

Not reproduced: the Glyph-ByT5 tokenizer's added color/font tokens (plain ByT5 here), the real
vocabularies, the VAE's 32x compression (4x here, so 64x64 images give 16x16 latents).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dpipe.models.common.tiny_files import save_exact_shards, save_parts
from dpipe.models.tiny_parts import seeded, tiny_t5_encoder, tiny_writer, write_json

LATENT_CHANNELS = 16
QWEN_DIM, BYT5_DIM = 32, 24
HEADS, HEAD_DIM = 2, 16
# HunyuanImagePipeline.prompt_template_encode: its first 34 tokens are cut off the embeddings.
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
            "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
            "<|im_start|>user\n{}<|im_end|>")
TEMPLATE_TOKENS = 34


@tiny_writer
def make_tiny_hunyuan_image(out: Path, seed: int) -> None:
    """A tiny random HunyuanImage 2.1 diffusers folder."""
    from diffusers import (
        AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler, HunyuanImagePipeline,
        HunyuanImageTransformer2DModel)
    from diffusers.guiders import AdaptiveProjectedMixGuidance
    from transformers import (
        ByT5Tokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer)

    ids = save_qwen_tokenizer_with(out / "tokenizer", TEMPLATE.format(""))
    byt5 = ByT5Tokenizer()
    byt5.save_pretrained(out / "tokenizer_2")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    with seeded(seed):
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=max(ids.values()) + 1, hidden_size=QWEN_DIM, intermediate_size=64,
                num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
            vision_config=dict(
                depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                out_hidden_size=QWEN_DIM, fullatt_block_indexes=[1], patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, window_size=112),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"]))
    with seeded(seed + 1):
        text_encoder_2 = tiny_t5_encoder(len(byt5), BYT5_DIM, 48, d_kv=12)  # ByT5's 384 ids
    with seeded(seed + 2):
        transformer = HunyuanImageTransformer2DModel(
            in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM, num_layers=2, num_single_layers=2, num_refiner_layers=2,
            mlp_ratio=4.0, patch_size=(1, 1), qk_norm="rms_norm", guidance_embeds=False,
            text_embed_dim=QWEN_DIM, text_embed_2_dim=BYT5_DIM, rope_theta=256.0,
            rope_axes_dim=(8, 8), use_meanflow=False)
    with seeded(seed + 3):
        vae = AutoencoderKLHunyuanImage(
            in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
            block_out_channels=(32, 32, 64), layers_per_block=1, spatial_compression_ratio=4,
            sample_size=64, scaling_factor=0.75289)
    guider = AdaptiveProjectedMixGuidance(guidance_scale=3.5)
    ocr_guider = AdaptiveProjectedMixGuidance(guidance_scale=3.5)

    save_parts(out, save_exact_shards, torch.float32, scheduler, transformer=(transformer, 1),
               vae=(vae, 1), text_encoder=(text_encoder, 1), text_encoder_2=(text_encoder_2, 1))
    guider.save_pretrained(out / "guider")
    ocr_guider.save_pretrained(out / "ocr_guider")
    pipe = HunyuanImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder,
        tokenizer=Qwen2Tokenizer.from_pretrained(out / "tokenizer"), text_encoder_2=text_encoder_2,
        tokenizer_2=ByT5Tokenizer.from_pretrained(out / "tokenizer_2"), transformer=transformer,
        guider=guider, ocr_guider=ocr_guider)
    pipe.save_config(out)


def write_single_file(folder: Path, file: Path, prefix: str = "", form: str = "fused") -> Path:
    """The transformer of the tiny folder at `folder` as one file in Tencent's original layout
    (hunyuanimage2.1.safetensors: `double_blocks.N.img_attn_qkv`, ...; `form`: see
    hunyuan_image/original.py), keys behind `prefix` ("model.diffusion_model." as ComfyUI saves
    it)."""
    from dpipe.models.hunyuan_image.original import to_original
    from dpipe.models.single_file import write_transformer_file

    config = json.loads((Path(folder) / "transformer" / "config.json").read_text())
    return write_transformer_file(Path(folder) / "transformer", file,
                                  lambda weights: to_original(weights, config, form), prefix)


def save_qwen_tokenizer_with(directory: Path, template: str) -> dict[str, int]:
    """A Qwen2.5-VL tokenizer folder as `dpipe.models.common.tiny_qwen_tokenizer` writes it, with
    merges learnt on the test captions plus `template` (so its words are whole tokens).
    Returns {added token: id}."""
    from dpipe.models.common import tiny_qwen_tokenizer as qt

    specials = [t for t, _ in qt.QWEN2_ADDED]
    plain = template
    for s in specials:
        plain = plain.replace(s, "\n")  # split there, as the added tokens split the text
    # Seen often enough for every word to merge fully.
    vocab, merges = qt.train_qwen_bpe(768, (plain,) * 4)
    ids = qt.save_vocab_files(directory, vocab, merges, specials)
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    write_json(directory / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(ids[t]): {"content": t, **entry, "special": s}
                                 for t, s in qt.QWEN2_ADDED},
        "bos_token": None, "chat_template": qt.QWEN2_VL_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    })
    return ids
