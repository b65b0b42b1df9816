"""The diffusers-folder helpers every family loads through: a broken folder is named, not a
traceback, and the encoders come frozen and without the denoiser."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from dpipe.errors import ModelLoadError
from dpipe.models.diffusers_folder import (
    check_folder, kl_latents, load_denoiser, load_encoders, read_json)
from dpipe.models.flux.tiny import make_tiny_flux


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory) -> Path:
    return make_tiny_flux(tmp_path_factory.mktemp("models") / "flux")


def test_check_folder_names_the_key_and_what_is_missing(tmp_path):
    with pytest.raises(ModelLoadError, match=r"model\.path=.*does not exist.*e\.g\. a download "
                                             r"of org/name"):
        check_folder(tmp_path / "nowhere", ("vae",), "Some", "org/name")
    (tmp_path / "vae").mkdir()
    with pytest.raises(ModelLoadError, match=r"model\.high_noise_path=.*not a complete Some "
                                             r"diffusers folder: missing transformer, tokenizer"):
        check_folder(tmp_path, ("vae", "transformer", "tokenizer"), "Some", "org/name",
                     key="model.high_noise_path")
    check_folder(tmp_path, ("vae",), "Some", "org/name")  # complete: no error


def test_read_json_names_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelLoadError, match=f"cannot read {bad}"):
        read_json(bad)
    with pytest.raises(ModelLoadError, match="cannot read .*missing.json"):
        read_json(tmp_path / "missing.json")


def test_encoders_come_frozen_without_the_denoiser(tiny_flux):
    pipe = load_encoders(FluxPipeline, tiny_flux, torch.device("cpu"), torch.float32,
                         frozen=("vae", "text_encoder", "text_encoder_2"))
    assert pipe.transformer is None
    for part in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        assert not part.training
        assert not any(p.requires_grad for p in part.parameters())
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    latents = kl_latents(pipe.vae, pixels)
    mode = pipe.vae.encode(pixels).latent_dist.mode()
    c = pipe.vae.config
    torch.testing.assert_close(latents, (mode - c.shift_factor) * c.scaling_factor)


def test_a_broken_denoiser_names_its_folder(tiny_flux, tmp_path):
    model = load_denoiser(FluxTransformer2DModel, tiny_flux, None, torch.float32)
    assert isinstance(model, FluxTransformer2DModel)
    broken = tmp_path / "flux"
    shutil.copytree(tiny_flux, broken)
    for weights in (broken / "transformer").glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match=f"cannot load {broken / 'transformer'}"):
        load_denoiser(FluxTransformer2DModel, broken, None, torch.float32)
