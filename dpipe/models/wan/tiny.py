"""Tiny random Wan 2.1 / 2.2 models, written in the layout of the Wan-AI `-Diffusers` repos.

Tests and CI cannot download the real checkpoints, so they run the real loading code
(`WanPipeline` / `WanImageToVideoPipeline.from_pretrained`, `WanTransformer3DModel.from_pretrained(
subfolder=...)`) on these folders. Kept as in the real repos: the pipeline class and components in
model_index.json (with `boundary_ratio` / `expand_timesteps` where Wan 2.2 has them), the UniPC
scheduler config with its flow shift, a UMT5 encoder with a T5 tokenizer, the Wan VAE with the real
latent normalisation (2.1: 16 channels, 8x8 spatial and 4x temporal compression; 2.2: 48 channels,
16x16 spatial through its 2x2 patchify), the CLIP vision encoder and its image processor for 2.1
i2v, sharded transformer and text-encoder weights with index files, and the stored dtypes
(transformer and VAE in fp32, text and image encoders in bf16). Only the sizes shrink.

Variants (`VARIANTS`), each the layout of one real repo:
  wan21_t2v       Wan-AI/Wan2.1-T2V-14B-Diffusers (and 1.3B)
  wan21_i2v       Wan-AI/Wan2.1-I2V-14B-480P-Diffusers: 36 input channels, CLIP image tokens
  wan21_flf2v     Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers: wan21_i2v with a position table over
                  the CLIP tokens of two frames (pos_embed_seq_len 514)
  wan22_ti2v      Wan-AI/Wan2.2-TI2V-5B-Diffusers: 48-channel VAE, per-token timesteps
  wan22_a14b      Wan-AI/Wan2.2-T2V-A14B-Diffusers: high-noise `transformer`, low-noise
                  `transformer_2`, boundary_ratio 0.875
  wan22_i2v_a14b  Wan-AI/Wan2.2-I2V-A14B-Diffusers: the same with 36 input channels, boundary 0.9

Sizes: 64x64 images -> 8x8 latents (2.1) or 4x4 (2.2) -> 2x2 patches -> 16 or 4 tokens per latent
frame; 5 frames -> 2 latent frames. Text: UMT5 with d_model 32, padded to 512 tokens as Wan does.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from dpipe.models.common.tiny_files import save_exact_shards
from dpipe.models.tiny_parts import (
    named_variant, save_model_index, save_t5_tokenizer, seeded, tiny_t5_encoder, write_once)
from dpipe.models.wan.sizes import HEAD_DIM, HEADS, TEXT_DIM, WAN_TINY

IMAGE_DIM = 32  # CLIP vision hidden size = the i2v transformer's image_dim
CLIP_TOKENS = (224 // 14) ** 2 + 1  # of the image encoder below: a 224 crop in 14 px patches
TEXT_MAX_LENGTH = 512  # Wan pads every prompt to 512 tokens; the i2v attention relies on it

_WAN21_VAE = dict(z_dim=16)  # the constructor's defaults are Wan 2.1's latents_mean/std
# Wan 2.2's VAE: 48 latent channels, 2x2 pixel patchify in front (hence 12 in/out channels).
_WAN22_VAE_MEAN = [round(0.05 * ((i * 37) % 21 - 10), 4) for i in range(48)]
_WAN22_VAE_STD = [round(0.4 + 0.05 * ((i * 11) % 13), 4) for i in range(48)]
_WAN22_VAE = dict(z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                  scale_factor_spatial=16, scale_factor_temporal=4,
                  latents_mean=_WAN22_VAE_MEAN, latents_std=_WAN22_VAE_STD)

VARIANTS: dict[str, dict] = {
    "wan21_t2v": dict(pipeline="WanPipeline", vae=_WAN21_VAE, in_channels=16, experts=1,
                      flow_shift=5.0),
    "wan21_i2v": dict(pipeline="WanImageToVideoPipeline", vae=_WAN21_VAE, in_channels=36,
                      experts=1, clip=True, flow_shift=3.0),
    "wan21_flf2v": dict(pipeline="WanImageToVideoPipeline", vae=_WAN21_VAE, in_channels=36,
                        experts=1, clip=True, flf2v=True, flow_shift=5.0),
    "wan22_ti2v": dict(pipeline="WanPipeline", vae=_WAN22_VAE, in_channels=48, experts=1,
                       flow_shift=5.0, expand_timesteps=True),
    "wan22_a14b": dict(pipeline="WanPipeline", vae=_WAN21_VAE, in_channels=16, experts=2,
                       flow_shift=12.0, boundary_ratio=0.875),
    "wan22_i2v_a14b": dict(pipeline="WanImageToVideoPipeline", vae=_WAN21_VAE, in_channels=36,
                           experts=2, flow_shift=5.0, boundary_ratio=0.9),
}


def make_tiny_wan(path: Path, seed: int = 0, variant: str = "wan21_t2v") -> Path:
    """Write (once) a tiny random Wan diffusers folder of `variant` at `path`; return `path`.

    An existing complete folder is returned untouched; the build happens in a temporary sibling
    folder renamed into place, so concurrent callers (pytest workers, pipeline ranks) are safe.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny Wan variant {variant!r}; choose one of {sorted(VARIANTS)}")
    return write_once(path, "model_index.json", lambda tmp: _write(tmp, seed, variant),
                      "make_tiny_wan")


def make_named_tiny_wan(path: Path, key: str = "model.path") -> Path:
    """The tiny model of the variant the folder's name gives: .../tiny-<variant>, e.g.
    tiny-wan22_ti2v (model.tiny=true); `key` is the setting that names the folder."""
    return make_tiny_wan(path, variant=named_variant(path, "tiny-", VARIANTS, "Wan", key))


make_tiny_wan_i2v = functools.partial(make_tiny_wan, variant="wan21_i2v")
make_tiny_wan_flf2v = functools.partial(make_tiny_wan, variant="wan21_flf2v")
make_tiny_wan22_ti2v = functools.partial(make_tiny_wan, variant="wan22_ti2v")
make_tiny_wan22_a14b = functools.partial(make_tiny_wan, variant="wan22_a14b")
make_tiny_wan22_i2v_a14b = functools.partial(make_tiny_wan, variant="wan22_i2v_a14b")


def _write(out: Path, seed: int, variant: str) -> None:
    from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline,
                           WanPipeline, WanTransformer3DModel)
    from transformers import T5TokenizerFast

    v = VARIANTS[variant]
    vocab = save_t5_tokenizer(out / "tokenizer", model_max_length=TEXT_MAX_LENGTH)
    # The scheduler config of the Wan repos: UniPC over flow-matching sigmas with a fixed shift.
    scheduler = UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
        flow_shift=v["flow_shift"], solver_order=2, predict_x0=True, solver_type="bh2",
        lower_order_final=True, timestep_spacing="linspace")

    # Each component gets its own seed, so resizing one leaves the others' weights unchanged.
    with seeded(seed):
        text_encoder = tiny_t5_encoder(vocab, TEXT_DIM, d_ff=64, umt5=True)
    with seeded(seed + 1):
        vae = AutoencoderKLWan(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True], **v["vae"])
    z_dim = v["vae"]["z_dim"]
    transformers = []
    for expert in range(v["experts"]):
        with seeded(seed + 2 + expert):
            transformers.append(WanTransformer3DModel.from_config({
                **WAN_TINY, "in_channels": v["in_channels"], "out_channels": z_dim,
                "image_dim": IMAGE_DIM if v.get("clip") else None,
                "added_kv_proj_dim": HEADS * HEAD_DIM if v.get("clip") else None,
                # FLF2V: a position table over the CLIP tokens of the first and last frames.
                "pos_embed_seq_len": 2 * CLIP_TOKENS if v.get("flf2v") else None}))

    scheduler.save_pretrained(out / "scheduler")
    save_exact_shards(text_encoder, out / "text_encoder", shards=2, dtype=torch.bfloat16)
    save_exact_shards(vae, out / "vae", shards=1, dtype=torch.float32)
    for name, model in zip(("transformer", "transformer_2"), transformers):
        save_exact_shards(model, out / name, shards=3, dtype=torch.float32)
    parts = dict(tokenizer=T5TokenizerFast.from_pretrained(out / "tokenizer"),
                 text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                 transformer=transformers[0],
                 transformer_2=transformers[1] if len(transformers) > 1 else None,
                 boundary_ratio=v.get("boundary_ratio"),
                 expand_timesteps=v.get("expand_timesteps", False))
    if v["pipeline"] == "WanImageToVideoPipeline":
        image_encoder, image_processor = _clip_parts(out, seed) if v.get("clip") else (None, None)
        pipe = WanImageToVideoPipeline(image_encoder=image_encoder,
                                       image_processor=image_processor, **parts)
    else:
        pipe = WanPipeline(**parts)
    # transformers 5 folds T5TokenizerFast into T5Tokenizer; the real repos name the Fast class.
    save_model_index(pipe, out, tokenizer=["transformers", "T5TokenizerFast"])


def _clip_parts(out: Path, seed: int):
    """Wan 2.1 i2v's image encoder (open-clip ViT-H/14 as CLIPVisionModelWithProjection, 257
    tokens of a 224x224 crop) and its CLIPImageProcessor, shrunk in width and depth only."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    with seeded(seed + 4):
        encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
            hidden_size=IMAGE_DIM, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, image_size=224, patch_size=14, projection_dim=IMAGE_DIM,
            hidden_act="gelu", layer_norm_eps=1e-5))
    processor = CLIPImageProcessor(
        do_resize=True, size={"shortest_edge": 224}, resample=3, do_center_crop=True,
        crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711], do_convert_rgb=True)
    save_exact_shards(encoder, out / "image_encoder", shards=1, dtype=torch.bfloat16)
    processor.save_pretrained(out / "image_processor")
    return encoder, processor
