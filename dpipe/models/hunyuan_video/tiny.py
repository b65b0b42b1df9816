"""A tiny random HunyuanVideo, written in exactly the layout of hunyuanvideo-community/HunyuanVideo.

The real folder: model_index.json (HunyuanVideoPipeline), scheduler/ (flow matching, shift 7),
transformer/ (HunyuanVideoTransformer3DModel, 3 bf16 shards + index), vae/
(AutoencoderKLHunyuanVideo), text_encoder/ (LlamaModel, sharded + index), tokenizer/ (a Llama-3
byte-level BPE tokenizer.json), text_encoder_2/ (CLIPTextModel) and tokenizer_2/ (CLIP vocab/merges).
Only the sizes shrink; the loaders are the ones that load the real checkpoint.

Sizes: 64x64 images (or 4k+1 frames of them) -> VAE (4x spatial, 4x temporal, 4 channels) -> 16x16
latents per latent frame -> 2x2 patches -> 64 tokens of width 32 per latent frame. LLaMA: hidden 32,
3 layers (the pipeline reads the third-from-last hidden state); CLIP: hidden 32 = pooled size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_files import save_sharded
from dpipe.models.common.tiny_llama3_tokenizer import LLAMA3_SPECIALS, save_llama3_tokenizer
from dpipe.models.hunyuan_video.sizes import HUNYUAN_VIDEO_TINY
from dpipe.models.tiny_parts import (
    save_clip_tokenizer, save_model_index, seeded, tiny_clip_text_config, tiny_writer)

LATENT_CHANNELS = 4
TEXT_DIM = 32  # LLaMA hidden size (text_embed_dim) and CLIP hidden size (pooled_projection_dim)
CLIP_MAX_LENGTH = 77
DTYPE = torch.bfloat16  # as the real repo stores the transformer; loaders pass the compute dtype


@tiny_writer
def make_tiny_hunyuan_video(out: Path, seed: int) -> None:
    """A tiny random HunyuanVideo diffusers folder."""
    from diffusers import (
        AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel)
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from transformers import CLIPTextModel, CLIPTokenizer, LlamaConfig, LlamaModel

    from dpipe.models.common.tiny_llama3_tokenizer import load_byte_level_tokenizer

    llama_vocab = save_llama3_tokenizer(out / "tokenizer",
                                        extra_text=(DEFAULT_PROMPT_TEMPLATE["template"],))
    clip_vocab = save_clip_tokenizer(out / "tokenizer_2", model_max_length=CLIP_MAX_LENGTH)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=7.0)

    with seeded(seed):
        text_encoder = LlamaModel(LlamaConfig(
            vocab_size=round_up(llama_vocab, 64), hidden_size=TEXT_DIM, intermediate_size=64,
            num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500000.0,
            bos_token_id=llama_vocab - len(LLAMA3_SPECIALS),
            eos_token_id=llama_vocab - len(LLAMA3_SPECIALS) + 1, tie_word_embeddings=False))
    with seeded(seed + 1):
        text_encoder_2 = CLIPTextModel(tiny_clip_text_config(clip_vocab, TEXT_DIM))
    with seeded(seed + 2):
        transformer = HunyuanVideoTransformer3DModel.from_config(HUNYUAN_VIDEO_TINY)
    with seeded(seed + 3):
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3,
            # Three levels: 4x spatial (the real VAE: four levels, 8x); 4x temporal as the real one,
            # so clips have 4k+1 frames exactly as with the real model.
            block_out_channels=(8, 16, 16), layers_per_block=1, norm_num_groups=4,
            scaling_factor=0.476986, spatial_compression_ratio=4, temporal_compression_ratio=4,
            mid_block_add_attention=True)

    scheduler.save_pretrained(out / "scheduler")
    save_sharded(transformer, out / "transformer", shards=3)
    save_sharded(text_encoder, out / "text_encoder", shards=2, dtype=torch.float16)
    save_sharded(text_encoder_2, out / "text_encoder_2", shards=1, dtype=torch.float16)
    save_sharded(vae, out / "vae", shards=1, dtype=torch.float32)

    pipe = HunyuanVideoPipeline(
        text_encoder=text_encoder, tokenizer=load_byte_level_tokenizer(out / "tokenizer"),
        transformer=transformer, vae=vae, scheduler=scheduler, text_encoder_2=text_encoder_2,
        tokenizer_2=CLIPTokenizer.from_pretrained(out / "tokenizer_2"))
    # The real folder names LlamaTokenizerFast (which transformers 5 loads wrongly; see tokenizers.py).
    save_model_index(pipe, out, tokenizer=["transformers", "LlamaTokenizerFast"])


def write_single_file(folder: Path, file: Path, prefix: str = "") -> Path:
    """The transformer of the tiny folder at `folder` as one file in the original layout
    (hunyuan_video_720_cfgdistill_bf16.safetensors: original names, bf16), keys behind `prefix`
    ("model.diffusion_model." as ComfyUI saves it)."""
    from dpipe.models.hunyuan_video.original import original_state_dict
    from dpipe.models.single_file import write_transformer_file

    return write_transformer_file(Path(folder) / "transformer", file, original_state_dict, prefix,
                                  DTYPE, format_metadata=False)
