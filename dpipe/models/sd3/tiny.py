"""A tiny random Stable Diffusion 3.5 (medium), in the diffusers layout of
stabilityai/stable-diffusion-3.5-medium.

CI cannot download the real checkpoint, so tests run the real loading code
(`StableDiffusion3Pipeline.from_pretrained`, `SD3Transformer2DModel.from_pretrained(subfolder=...)`)
on this folder. Kept as in the real repo: the component classes in model_index.json (with the
unused `image_encoder` / `feature_extractor` slots as nulls), the scheduler config (shift 3.0), two
CLIP tokenizers (the second pads with "!" as CLIP-G's does) and a T5 tokenizer, T5 weights sharded
with an index, and the VAE's 16-channel latent normalisation (scale 1.5305, shift 0.0609) with no
quant convs. Only the sizes shrink. The transformer has 3 joint blocks: block 0 uses SD3.5-medium's
dual attention (`attn2`), the last one is `context_pre_only` as in every SD3, and attention uses
SD3.5's RMS q/k norm, so every code path of the real 3.5 models runs.

Sizes: 64x64 images -> VAE (4x downscale, 4 latent channels) -> 16x16 latents -> 2x2 patches -> 64
image tokens; text: CLIP-L and CLIP-G (77 tokens, hidden 32 each, projections 32 each -> pooled 64)
and T5 (d_model 64 = joint attention dim, which the 2x32 CLIP features are padded to).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.tiny_files import save_exact_shards, save_parts
from dpipe.models.common.tiny_vae import tiny_flux_vae
from dpipe.models.tiny_parts import (
    save_clip_tokenizer, save_model_index, save_t5_tokenizer, seeded, tiny_clip_text_config,
    tiny_t5_encoder, tiny_writer)

LATENT_CHANNELS = 4
CLIP_DIM = 32
T5_DIM = 2 * CLIP_DIM  # SD3 pads the concatenated CLIP features up to the T5 width
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512
DTYPE = torch.bfloat16


@tiny_writer
def make_tiny_sd3(out: Path, seed: int) -> None:
    """A tiny random SD3.5-medium diffusers folder."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline)
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5TokenizerFast

    clip_vocab = save_clip_tokenizer(out / "tokenizer", model_max_length=CLIP_MAX_LENGTH)
    save_clip_tokenizer(out / "tokenizer_2", model_max_length=CLIP_MAX_LENGTH, pad="!")
    t5_vocab = save_t5_tokenizer(out / "tokenizer_3", model_max_length=T5_MAX_LENGTH)

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    with seeded(seed):  # CLIP ViT-L/14
        text_encoder = CLIPTextModelWithProjection(tiny_clip_text_config(clip_vocab, CLIP_DIM))
    with seeded(seed + 1):  # OpenCLIP bigG
        text_encoder_2 = CLIPTextModelWithProjection(
            tiny_clip_text_config(clip_vocab, CLIP_DIM, act="gelu"))
    with seeded(seed + 2):
        text_encoder_3 = tiny_t5_encoder(t5_vocab, T5_DIM, d_ff=96)
    with seeded(seed + 3):
        transformer = SD3Transformer2DModel(
            sample_size=32, patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
            num_layers=3, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=T5_DIM, caption_projection_dim=16,
            pooled_projection_dim=2 * CLIP_DIM, pos_embed_max_size=32,
            dual_attention_layers=(0,), qk_norm="rms_norm")
    with seeded(seed + 4):
        vae = tiny_flux_vae(LATENT_CHANNELS, scaling_factor=1.5305, shift_factor=0.0609)

    save_parts(out, save_exact_shards, DTYPE, scheduler, transformer=(transformer, 1),
               vae=(vae, 1), text_encoder=(text_encoder, 1), text_encoder_2=(text_encoder_2, 1),
               text_encoder_3=(text_encoder_3, 2))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=CLIPTokenizer.from_pretrained(out / "tokenizer"),
        text_encoder_2=text_encoder_2,
        tokenizer_2=CLIPTokenizer.from_pretrained(out / "tokenizer_2"),
        text_encoder_3=text_encoder_3,
        tokenizer_3=T5TokenizerFast.from_pretrained(out / "tokenizer_3"))
    # As the real repo has them: tokenizer_3's Fast class, the unused image slots as nulls.
    save_model_index(pipe, out, tokenizer_3=["transformers", "T5TokenizerFast"],
                     image_encoder=[None, None], feature_extractor=[None, None])


def write_single_file(folder: Path, file: Path, prefix: str = "") -> Path:
    """The transformer of the tiny folder at `folder` as one file in Stability AI's layout
    (sd3.5_medium.safetensors: original MMDiT names, bf16), keys behind `prefix`
    ("model.diffusion_model." as the released files and ComfyUI's saves have them)."""
    from dpipe.models.sd3.original import original_state_dict
    from dpipe.models.single_file import write_transformer_file

    return write_transformer_file(Path(folder) / "transformer", file, original_state_dict, prefix)
