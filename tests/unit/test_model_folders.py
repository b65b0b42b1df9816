"""What `check_folder` tells a user whose model.path is not a usable diffusers folder: a single
file where the family reads folders, a quantized denoiser, missing parts."""

from __future__ import annotations

import json

import pytest

from dpipe.errors import ModelLoadError
from dpipe.models.diffusers_folder import check_folder

REQUIRED = ("model_index.json", "transformer", "vae")


def folder(root, transformer_config: dict):
    (root / "vae").mkdir(parents=True)
    (root / "transformer").mkdir()
    (root / "model_index.json").write_text("{}")
    (root / "transformer" / "config.json").write_text(json.dumps(transformer_config))
    return root


def test_a_complete_folder_passes(tmp_path):
    check_folder(folder(tmp_path / "m", {"num_layers": 2}), REQUIRED, "Krea 2", "krea/krea-2")


def test_a_single_file_is_named_as_a_file(tmp_path):
    file = tmp_path / "krea2.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=rf"model.path={file} is a file: Krea 2 loads from a "
                                             "diffusers folder here"):
        check_folder(file, REQUIRED, "Krea 2", "krea/krea-2")


def test_a_quantized_denoiser_is_refused_naming_its_config(tmp_path):
    root = folder(tmp_path / "m", {"quantization_config": {"quant_method": "bitsandbytes",
                                                           "load_in_4bit": True}})
    config = root / "transformer" / "config.json"
    with pytest.raises(ModelLoadError, match=rf"{config} holds a quantization_config "
                                             r"\(bitsandbytes\)"):
        check_folder(root, REQUIRED, "Ideogram 4", "ideogram-ai/ideogram-4")


def test_missing_parts_are_listed(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    with pytest.raises(ModelLoadError, match="missing model_index.json, transformer, vae"):
        check_folder(root, REQUIRED, "Krea 2", "krea/krea-2")
