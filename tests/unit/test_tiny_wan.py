"""The tiny Wan 2.1 / 2.2 folders load and run through diffusers' real loading code."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline,
                       WanPipeline, WanTransformer3DModel)
from PIL import Image
from safetensors import safe_open
from transformers import UMT5EncoderModel

from dpipe.models.wan.tiny import VARIANTS, make_tiny_wan

CAPTION = "a red circle on a blue background"
REPO_ROOT = Path(__file__).resolve().parents[2]
needs_ftfy = pytest.mark.skipif(importlib.util.find_spec("ftfy") is None,
                                reason="WanImageToVideoPipeline cleans prompts with ftfy")


@pytest.fixture(scope="module")
def folders(tiny_models) -> dict[str, Path]:
    return {v: make_tiny_wan(tiny_models / f"tiny-{v}", variant=v) for v in VARIANTS}


def _generate(pipe, **kwargs):
    # Two steps without classifier-free guidance: one transformer call per step.
    out = pipe(prompt=CAPTION, height=64, width=64, num_frames=5, num_inference_steps=2,
               guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np",
               **kwargs)
    return out.frames


@needs_ftfy
@pytest.mark.parametrize("variant", ["wan21_i2v", "wan22_i2v_a14b",
                                     pytest.param("wan21_flf2v", marks=pytest.mark.slow)])
def test_image_to_video_pipelines_generate(folders, variant):
    pipe = WanImageToVideoPipeline.from_pretrained(folders[variant], dtype=torch.float32)
    # FLF2V's image embedding takes the CLIP tokens of a first and a last frame.
    last = ({"last_image": Image.new("RGB", (64, 64), (40, 40, 220))}
            if variant == "wan21_flf2v" else {})
    frames = _generate(pipe, image=Image.new("RGB", (64, 64), (220, 40, 40)), **last)
    assert frames.shape == (1, 5, 64, 64, 3) and np.isfinite(frames).all()


def test_layouts_match_the_real_repos(folders):
    for variant, v in VARIANTS.items():
        root = folders[variant]
        index = json.loads((root / "model_index.json").read_text())
        assert index["_class_name"] == v["pipeline"], variant
        assert index["tokenizer"] == ["transformers", "T5TokenizerFast"]
        assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
        assert index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
        assert index.get("boundary_ratio") == v.get("boundary_ratio"), variant
        assert bool(index.get("expand_timesteps")) == v.get("expand_timesteps", False)
        has_two = index.get("transformer_2", [None])[0] is not None
        assert has_two == (v["experts"] == 2), variant
        if v.get("clip"):
            assert index["image_encoder"] == ["transformers", "CLIPVisionModelWithProjection"]
            assert (root / "image_processor" / "preprocessor_config.json").is_file()
        for rel in ["tokenizer/tokenizer.json", "text_encoder/model.safetensors.index.json",
                    "transformer/diffusion_pytorch_model.safetensors.index.json",
                    "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"]:
            assert (root / rel).is_file(), (variant, rel)
        assert len(list((root / "text_encoder").glob("*-of-00002.safetensors"))) == 2
    root = folders["wan21_t2v"]
    with safe_open(root / "text_encoder/model-00001-of-00002.safetensors", "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    with safe_open(root / "vae/diffusion_pytorch_model.safetensors", "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.float32
    scheduler = UniPCMultistepScheduler.from_pretrained(root, subfolder="scheduler")
    assert scheduler.config.use_flow_sigmas
    assert scheduler.config.prediction_type == "flow_prediction"


def test_shapes_match_the_declared_configs(folders):
    # Wan 2.1: 8x spatial, 4x temporal (4k+1 frames), 16 channels; 2.2 TI2V: 16x, 48 channels.
    for variant, (z, h) in {"wan21_t2v": (16, 8), "wan22_ti2v": (48, 4)}.items():
        vae = AutoencoderKLWan.from_pretrained(folders[variant], subfolder="vae")
        latents = vae.encode(torch.zeros(1, 3, 5, 64, 64)).latent_dist.mode()
        assert latents.shape == (1, z, 2, h, h), variant
    transformer = WanTransformer3DModel.from_pretrained(folders["wan21_i2v"],
                                                        subfolder="transformer")
    assert transformer.config.in_channels == 36 and transformer.config.image_dim == 32
    flf2v = WanTransformer3DModel.from_pretrained(folders["wan21_flf2v"], subfolder="transformer")
    assert flf2v.config.pos_embed_seq_len == 2 * 257  # two frames' CLIP tokens
    text_encoder = UMT5EncoderModel.from_pretrained(folders["wan21_t2v"] / "text_encoder")
    assert text_encoder.config.d_model == WanTransformer3DModel.from_pretrained(
        folders["wan21_t2v"], subfolder="transformer").config.text_dim
    pipe = WanPipeline.from_pretrained(folders["wan21_t2v"], transformer=None, vae=None,
                                       dtype=torch.float32)
    assert pipe.tokenizer.unk_token_id not in pipe.tokenizer(CAPTION).input_ids
    embeds, _ = pipe.encode_prompt(CAPTION, do_classifier_free_guidance=False)
    assert embeds.shape == (1, 226, 32)  # the pipeline's default length; Wan trains with 512


def test_the_two_experts_are_different_models(folders):
    root = folders["wan22_a14b"]
    shard = "diffusion_pytorch_model-00001-of-00003.safetensors"
    high, low = (root / "transformer" / shard), (root / "transformer_2" / shard)
    assert high.read_bytes() != low.read_bytes()


def test_refuses_a_foreign_folder_and_an_unknown_variant(tmp_path):
    (tmp_path / "wan").mkdir()
    (tmp_path / "wan" / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="model_index.json"):
        make_tiny_wan(tmp_path / "wan")
    with pytest.raises(ValueError, match="wan21_t2v"):
        make_tiny_wan(tmp_path / "other", variant="wan3")


def test_cli_writes_the_folder(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model", REPO_ROOT / "scripts" / "make_tiny_model.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["wan22_ti2v", str(tmp_path / "cli"), "--seed", "2"]) == 0
    index = json.loads((tmp_path / "cli" / "model_index.json").read_text())
    assert index["expand_timesteps"] is True


def test_its_transformer_as_a_gguf_is_read_kept_quantized(folders, tmp_path):
    """Wan 2.1 T2V's transformer in ComfyUI's layout as a Q8_0 GGUF (city96's `wan`)."""
    from omegaconf import OmegaConf

    from dpipe.config.schema import ModelConfig
    from dpipe.models.registry import build_spec
    from dpipe.models.single_file import write_transformer_file
    from dpipe.models.wan.comfyui import original_state_dict
    from tests.unit.test_gguf_files import assert_gguf_keeps_the_values

    folder = folders["wan21_t2v"]
    plain = write_transformer_file(folder / "transformer", tmp_path / "wan2.1_t2v.safetensors",
                                   original_state_dict, prefix="model.diffusion_model.")

    def spec(path):
        return build_spec(OmegaConf.to_object(OmegaConf.merge(
            OmegaConf.structured(ModelConfig), {"family": "wan", "path": str(path),
                                                "single_file_config": str(folder)})))
    assert_gguf_keeps_the_values(spec, plain, tmp_path)
