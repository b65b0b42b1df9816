"""The tiny SD3.5 folder loads and runs through diffusers' real loading code; SD3 specifics."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
    StableDiffusion3Pipeline)
from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from dpipe.models.sd3.spec import LORA_TARGETS
from dpipe.models.sd3.tiny import make_tiny_sd3

CAPTION = "a red circle on a blue background"


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory) -> Path:
    return make_tiny_sd3(tmp_path_factory.mktemp("models") / "sd3")


@pytest.fixture(scope="module")
def pipe(tiny_sd3) -> StableDiffusion3Pipeline:
    return StableDiffusion3Pipeline.from_pretrained(tiny_sd3, dtype=torch.float32)


def test_generates_an_image(pipe):
    out = pipe(CAPTION, height=64, width=64, num_inference_steps=2, guidance_scale=3.5,
               max_sequence_length=32, generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.images.shape == (1, 64, 64, 3)
    assert np.isfinite(out.images).all()


def test_components_and_layout(tiny_sd3, pipe):
    expected = {
        "scheduler": FlowMatchEulerDiscreteScheduler, "vae": AutoencoderKL,
        "text_encoder": CLIPTextModelWithProjection, "text_encoder_2": CLIPTextModelWithProjection,
        "text_encoder_3": T5EncoderModel, "tokenizer": CLIPTokenizer, "tokenizer_2": CLIPTokenizer,
        "tokenizer_3": T5TokenizerFast, "transformer": SD3Transformer2DModel,
    }
    for name, cls in expected.items():
        assert isinstance(getattr(pipe, name), cls), name
    index = json.loads((tiny_sd3 / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["image_encoder"] == [None, None] and index["feature_extractor"] == [None, None]
    for rel in ["tokenizer/vocab.json", "tokenizer_2/merges.txt", "tokenizer_3/tokenizer.json",
                "text_encoder_3/model.safetensors.index.json", "text_encoder/model.safetensors",
                "transformer/diffusion_pytorch_model.safetensors",
                "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"]:
        assert (tiny_sd3 / rel).is_file(), rel


def test_sd3_conventions(pipe):
    # CLIP-G's tokenizer pads with "!", CLIP-L's with <|endoftext|>, as in the real repo.
    assert pipe.tokenizer_2.pad_token == "!" and pipe.tokenizer.pad_token == "<|endoftext|>"
    assert pipe.scheduler.config.shift == 3.0 and not pipe.scheduler.config.use_dynamic_shifting
    assert (pipe.vae.config.latent_channels, pipe.vae.config.shift_factor,
            pipe.vae.config.scaling_factor) == (4, 0.0609, 1.5305)
    embeds, _, pooled, _ = pipe.encode_prompt(CAPTION, None, None,
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=32)
    assert embeds.shape == (1, 77 + 32, 64) and pooled.shape == (1, 64)


def test_lora_targets_cover_every_block_linear(pipe):
    transformer = pipe.transformer
    linears = {name for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    targeted = {name for name in linears if re.fullmatch(LORA_TARGETS, name)}
    in_blocks = {name for name in linears if name.startswith("transformer_blocks.")}
    assert targeted == in_blocks
    # SD3.5-medium's second attention and the last, context_pre_only, block are both covered.
    assert "transformer_blocks.0.attn2.to_q" in targeted
    assert "transformer_blocks.2.norm1_context.linear" in targeted
    assert not any(name.startswith("transformer_blocks.2.ff_context") for name in linears)


def test_idempotent_and_deterministic(tmp_path, tiny_sd3):
    assert make_tiny_sd3(tiny_sd3) == tiny_sd3
    again = make_tiny_sd3(tmp_path / "again", seed=0)
    files = sorted(p.relative_to(tiny_sd3) for p in tiny_sd3.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (tiny_sd3 / rel).read_bytes() == (again / rel).read_bytes(), rel
