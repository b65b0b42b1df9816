"""The tiny Cosmos-Predict2 folders load and run through diffusers' real loading code."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (AutoencoderKLWan, Cosmos2TextToImagePipeline, Cosmos2VideoToWorldPipeline,
                       CosmosTransformer3DModel)
from PIL import Image
from safetensors import safe_open

from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision
from dpipe.models.cosmos_predict2.tiny import VARIANTS, make_tiny_cosmos_predict2

CAPTION = "a red circle on a blue background"
REPO_ROOT = Path(__file__).resolve().parents[2]


class _NoGuardrail:
    """Stands in for cosmos_guardrail's CosmosSafetyChecker (not installable offline)."""

    def to(self, *args, **kwargs):
        return self

    def check_text_safety(self, prompt):
        return True

    def check_video_safety(self, video):
        return video


@pytest.fixture(scope="module")
def folders(tiny_models) -> dict[str, Path]:
    return {v: make_tiny_cosmos_predict2(tiny_models / f"tiny-cosmos_predict2_{v}", variant=v) for v in VARIANTS}


def test_text2image_pipeline_generates(folders):
    pipe = Cosmos2TextToImagePipeline.from_pretrained(
        folders["text2image"], safety_checker=_NoGuardrail(), dtype=torch.float32)
    with nearest_resize_without_torchvision():
        image = pipe(prompt=CAPTION, height=64, width=64, num_inference_steps=2,
                     guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
                     output_type="np").images
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()


def test_video2world_pipeline_generates_from_an_image(folders):
    pipe = Cosmos2VideoToWorldPipeline.from_pretrained(
        folders["video2world"], safety_checker=_NoGuardrail(), dtype=torch.float32)
    with nearest_resize_without_torchvision():
        frames = pipe(image=Image.new("RGB", (64, 64), (220, 40, 40)), prompt=CAPTION, height=64,
                      width=64, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
                      generator=torch.Generator().manual_seed(0), output_type="np").frames
    assert frames.shape == (1, 5, 64, 64, 3) and np.isfinite(frames).all()


def test_layouts_match_the_real_repos(folders):
    for variant, v in VARIANTS.items():
        root = folders[variant]
        index = json.loads((root / "model_index.json").read_text())
        assert index["_class_name"] == v["pipeline"]
        assert index["vae"] == ["diffusers", "AutoencoderKLWan"]
        assert index["text_encoder"] == ["transformers", "T5EncoderModel"]
        assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
        config = CosmosTransformer3DModel.load_config(root / "transformer")
        assert config["in_channels"] == v["in_channels"] and config["concat_padding_mask"]
        assert config["extra_pos_embed_type"] is None
        assert tuple(config["rope_scale"]) == v["rope_scale"]
        for rel in ["tokenizer/tokenizer.json", "text_encoder/model.safetensors.index.json",
                    "transformer/diffusion_pytorch_model.safetensors.index.json",
                    "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"]:
            assert (root / rel).is_file(), (variant, rel)
    shard = next((folders["text2image"] / "transformer").glob("*-of-*.safetensors"))
    with safe_open(shard, "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16


def test_shapes_match_the_declared_configs(folders):
    vae = AutoencoderKLWan.from_pretrained(folders["video2world"], subfolder="vae")
    assert vae.encode(torch.zeros(1, 3, 5, 64, 64)).latent_dist.mode().shape == (1, 16, 2, 8, 8)
    pipe = Cosmos2TextToImagePipeline.from_pretrained(
        folders["text2image"], transformer=None, vae=None, safety_checker=_NoGuardrail())
    embeds, _ = pipe.encode_prompt(CAPTION, do_classifier_free_guidance=False)
    assert embeds.shape == (1, 512, 32)
    length = len(pipe.tokenizer(CAPTION).input_ids)
    assert embeds[0, length:].abs().sum() == 0 and embeds[0, :length].abs().sum() > 0


def test_an_unknown_variant_is_named(tmp_path):
    with pytest.raises(ValueError, match="text2image"):
        make_tiny_cosmos_predict2(tmp_path / "x", variant="predict3")


def test_cli_writes_the_folder(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model", REPO_ROOT / "scripts" / "make_tiny_model.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["cosmos_predict2_v2w", str(tmp_path / "cli")]) == 0
    index = json.loads((tmp_path / "cli" / "model_index.json").read_text())
    assert index["_class_name"] == "Cosmos2VideoToWorldPipeline"
