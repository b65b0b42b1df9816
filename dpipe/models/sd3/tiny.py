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

import json
from pathlib import Path

import torch

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_vae import tiny_flux_vae
from dpipe.models.tiny_parts import (
    save_clip_tokenizer, save_t5_tokenizer, seeded, tiny_t5_config, write_once)

LATENT_CHANNELS = 4
CLIP_DIM = 32
T5_DIM = 2 * CLIP_DIM  # SD3 pads the concatenated CLIP features up to the T5 width
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512
DTYPE = torch.bfloat16


def make_tiny_sd3(path: Path, seed: int = 0) -> Path:
    """Write (once) a tiny random SD3.5-medium diffusers folder at `path` and return `path`.

    An existing complete folder is returned untouched; the build happens in a temporary sibling
    folder renamed into place, so concurrent callers (pytest workers, pipeline ranks) are safe.
    """
    return write_once(path, "model_index.json", lambda tmp: _write(tmp, seed), "make_tiny_sd3")


def _write(out: Path, seed: int) -> None:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
        StableDiffusion3Pipeline)
    from transformers import (
        CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel,
        T5TokenizerFast)

    clip_vocab = save_clip_tokenizer(out / "tokenizer", model_max_length=CLIP_MAX_LENGTH)
    save_clip_tokenizer(out / "tokenizer_2", model_max_length=CLIP_MAX_LENGTH)
    _pad_with_exclamation_mark(out / "tokenizer_2")
    t5_vocab = save_t5_tokenizer(out / "tokenizer_3", model_max_length=T5_MAX_LENGTH)

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)

    def clip(act: str) -> CLIPTextModelWithProjection:
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=clip_vocab, hidden_size=CLIP_DIM, intermediate_size=4 * CLIP_DIM,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH,
            hidden_act=act, projection_dim=CLIP_DIM,
            # The real configs' legacy ids: pooling at argmax(input_ids), the first <|endoftext|>.
            bos_token_id=0, eos_token_id=2, pad_token_id=1))

    with seeded(seed):
        text_encoder = clip("quick_gelu")  # CLIP ViT-L/14
    with seeded(seed + 1):
        text_encoder_2 = clip("gelu")  # OpenCLIP bigG
    with seeded(seed + 2):
        text_encoder_3 = T5EncoderModel(T5Config(**tiny_t5_config(
            round_up(t5_vocab, 128), T5_DIM, d_ff=96)))
    with seeded(seed + 3):
        transformer = SD3Transformer2DModel(
            sample_size=32, patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
            num_layers=3, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=T5_DIM, caption_projection_dim=16,
            pooled_projection_dim=2 * CLIP_DIM, pos_embed_max_size=32,
            dual_attention_layers=(0,), qk_norm="rms_norm")
    with seeded(seed + 4):
        vae = tiny_flux_vae(LATENT_CHANNELS, scaling_factor=1.5305, shift_factor=0.0609)

    scheduler.save_pretrained(out / "scheduler")
    _save(transformer, out / "transformer", shards=1)
    _save(vae, out / "vae", shards=1)
    _save(text_encoder, out / "text_encoder", shards=1)
    _save(text_encoder_2, out / "text_encoder_2", shards=1)
    _save(text_encoder_3, out / "text_encoder_3", shards=2)

    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=CLIPTokenizer.from_pretrained(out / "tokenizer"),
        text_encoder_2=text_encoder_2,
        tokenizer_2=CLIPTokenizer.from_pretrained(out / "tokenizer_2"),
        text_encoder_3=text_encoder_3,
        tokenizer_3=T5TokenizerFast.from_pretrained(out / "tokenizer_3"))
    pipe.save_config(out)
    index = json.loads((out / "model_index.json").read_text())
    index["tokenizer_3"] = ["transformers", "T5TokenizerFast"]  # as the real repo names it
    index.setdefault("image_encoder", [None, None])
    index.setdefault("feature_extractor", [None, None])
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _pad_with_exclamation_mark(directory: Path) -> None:
    """SD3's tokenizer_2 (OpenCLIP bigG's) pads with "!" (id 0), not with <|endoftext|>."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / name
        data = json.loads(path.read_text(encoding="utf-8"))
        data["pad_token"] = "!"
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save(model: torch.nn.Module, directory: Path, shards: int) -> None:
    torch.nn.Module.to(model, DTYPE)
    if shards == 1:
        model.save_pretrained(directory)
        return
    unique = {t.data_ptr(): t for t in model.state_dict().values()}.values()
    sizes = [t.numel() * t.element_size() for t in unique]
    model.save_pretrained(directory, max_shard_size=-(-sum(sizes) // shards) + max(sizes))


def write_single_file(folder: Path, file: Path, prefix: str = "") -> Path:
    """The transformer of the tiny folder at `folder` as one file in Stability AI's layout
    (sd3.5_medium.safetensors: original MMDiT names, bf16), keys behind `prefix`
    ("model.diffusion_model." as the released files and ComfyUI's saves have them)."""
    from dpipe.models.sd3.original import original_state_dict
    from dpipe.models.single_file import write_transformer_file

    return write_transformer_file(Path(folder) / "transformer", file, original_state_dict, prefix)
