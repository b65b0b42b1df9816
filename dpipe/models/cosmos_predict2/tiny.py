"""Tiny random Cosmos-Predict2 models, written in the layout of the nvidia/Cosmos-Predict2-*
diffusers repos.

Tests and CI cannot download the real checkpoints, so they run the real loading code
(`CosmosTransformer3DModel.from_pretrained(subfolder=...)`, `Cosmos2TextToImagePipeline` /
`Cosmos2VideoToWorldPipeline.from_pretrained`) on these folders. Kept as in the real repos: the
pipeline class and components in model_index.json, the FlowMatchEulerDiscreteScheduler config
(Karras sigmas; the pipelines set sigma_max 80 / sigma_min 0.002 themselves), a T5 encoder (the
real one is T5-11B's, d_model 1024) with a T5 tokenizer, the Wan 2.1 VAE with its latent
normalisation, a transformer with the padding-mask channel (`concat_padding_mask`), no learnable
position embedding, Predict2's rope scales (Text2Image (1, 4, 4), Video2World (1, 3, 3)) and, for
Video2World, the condition-mask input channel (17 = 16 + 1); sharded transformer and T5 weights
with index files, stored in bf16. Only the sizes shrink. No safety checker is stored: the
pipelines build `CosmosSafetyChecker` (the cosmos_guardrail package) themselves.

Variants (`VARIANTS`): text2image (Cosmos-Predict2-2B-Text2Image), video2world
(Cosmos-Predict2-2B-Video2World). Sizes: 64x64 images -> 8x8 latents -> 2x2 patches -> 16 tokens
per latent frame; 5 frames -> 2 latent frames.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from dpipe.models.common.tiny_files import save_exact_shards, save_parts
from dpipe.models.tiny_parts import (
    named_variant, save_t5_tokenizer, seeded, tiny_t5_encoder, write_config, write_once)

TEXT_DIM = 32  # T5 d_model = the transformer's text_embed_dim (1024 in the real models)
TEXT_MAX_LENGTH = 512
DTYPE = torch.bfloat16

VARIANTS: dict[str, dict] = {
    "text2image": dict(pipeline="Cosmos2TextToImagePipeline", in_channels=16,
                       rope_scale=(1.0, 4.0, 4.0)),
    "video2world": dict(pipeline="Cosmos2VideoToWorldPipeline", in_channels=17,
                        rope_scale=(1.0, 3.0, 3.0)),
}


def make_tiny_cosmos_predict2(path: Path, seed: int = 0, variant: str = "text2image") -> Path:
    """Write (once) a tiny random Cosmos-Predict2 folder of `variant` at `path`; return `path`.

    An existing complete folder is returned untouched; the build happens in a temporary sibling
    folder renamed into place, so concurrent callers (pytest workers, pipeline ranks) are safe.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny Cosmos-Predict2 variant {variant!r}; choose one of "
                         f"{sorted(VARIANTS)}")
    return write_once(path, "model_index.json", lambda tmp: _write(tmp, seed, variant),
                      "make_tiny_cosmos_predict2")


def make_named_tiny_cosmos_predict2(path: Path) -> Path:
    """The tiny model of the variant the folder's name gives: .../tiny-cosmos_predict2_<variant>
    (model.tiny=true)."""
    return make_tiny_cosmos_predict2(path, variant=named_variant(
        path, "tiny-cosmos_predict2_", VARIANTS, "Cosmos-Predict2"))


make_tiny_cosmos_predict2_v2w = functools.partial(make_tiny_cosmos_predict2, variant="video2world")


def _write(out: Path, seed: int, variant: str) -> None:
    from diffusers import (AutoencoderKLWan, CosmosTransformer3DModel,
                           FlowMatchEulerDiscreteScheduler)

    v = VARIANTS[variant]
    vocab = save_t5_tokenizer(out / "tokenizer", model_max_length=TEXT_MAX_LENGTH)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, use_karras_sigmas=True,
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    with seeded(seed):
        text_encoder = tiny_t5_encoder(vocab, TEXT_DIM, d_ff=64, v1_1=False)  # T5-11B's: v1.0
    with seeded(seed + 1):
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    with seeded(seed + 2):
        transformer = CosmosTransformer3DModel(
            in_channels=v["in_channels"], out_channels=16, num_attention_heads=2,
            attention_head_dim=16, num_layers=2, mlp_ratio=2.0, text_embed_dim=TEXT_DIM,
            adaln_lora_dim=8, max_size=(128, 240, 240), patch_size=(1, 2, 2),
            rope_scale=v["rope_scale"], concat_padding_mask=True, extra_pos_embed_type=None)
        # diffusers zero-initialises nothing here; random adaLN weights keep every path alive.

    save_parts(out, save_exact_shards, DTYPE, scheduler, text_encoder=(text_encoder, 2),
               vae=(vae, 1), transformer=(transformer, 2))
    write_config(out / "model_index.json", {
        "_class_name": v["pipeline"],
        "_diffusers_version": "0.34.0.dev0",
        "safety_checker": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "CosmosTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    })


# Buffers of NVIDIA's training code in its checkpoints, which diffusers' converter drops.
_TRAINING_BUFFERS = ("pos_embedder.seq", "pos_embedder.dim_spatial_range",
                     "pos_embedder.dim_temporal_range", "accum_video_sample_counter",
                     "accum_image_sample_counter", "accum_iteration", "accum_train_in_hours")


def write_single_file(folder: Path, file: Path, prefix: str = "net.") -> Path:
    """The tiny folder's transformer in NVIDIA's single-file layout: `net.`-prefixed names (as
    NVIDIA's checkpoints and ComfyUI's repackaged files hold them; `prefix` changes it) with the
    training buffers, bf16; a .safetensors file, or a .pt (a plain state dict, torch.save)."""
    from dpipe.models.common.cosmos_names import original_state_dict
    from dpipe.models.single_file import write_transformer_file

    buffers = {prefix + name: torch.arange(4, dtype=torch.float32) for name in _TRAINING_BUFFERS}
    return write_transformer_file(Path(folder) / "transformer", file,
                                  lambda weights: original_state_dict(weights, prefix=prefix), "",
                                  DTYPE, buffers, format_metadata=False)
