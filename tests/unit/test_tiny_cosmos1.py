"""The tiny Cosmos 1.0 Text2World folder loads and generates through diffusers' real loading code;
its single files, ComfyUI names and refusals of other Cosmos folders."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLCosmos, CosmosTextToWorldPipeline, CosmosTransformer3DModel
from safetensors import safe_open

from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision
from dpipe.models.cosmos1.tiny import make_tiny_cosmos1, write_single_file

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
def folder(tiny_models) -> Path:
    return make_tiny_cosmos1(tiny_models / "tiny-cosmos1")


def _spec(path: Path, single_file_config: Path | None = None):
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec

    args = ["model=tiny_cosmos1", "dataset=synthetic", f"model.path={path}"]
    if single_file_config is not None:
        args.append(f"model.single_file_config={single_file_config}")
    return build_spec(compose_run(args).model)


def test_pipeline_generates_with_default_arguments(folder):
    """CosmosTextToWorldPipeline on the folder, as its docs call it (one torch dtype for every
    component, as with the real repo, whose T5 loads in bf16 otherwise; defaults but the size and
    two steps): a 9-frame video, and an image as one frame."""
    pipe = CosmosTextToWorldPipeline.from_pretrained(folder, safety_checker=_NoGuardrail(),
                                                     dtype=torch.float32)
    with nearest_resize_without_torchvision():
        for frames in (9, 1):
            video = pipe(prompt=CAPTION, height=64, width=64, num_frames=frames,
                         num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                         output_type="np").frames
            assert video.shape == (1, frames, 64, 64, 3) and np.isfinite(video).all()


def test_layout_matches_the_real_repo(folder):
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "CosmosTextToWorldPipeline"
    assert index["vae"] == ["diffusers", "AutoencoderKLCosmos"]
    assert index["scheduler"] == ["diffusers", "EDMEulerScheduler"]
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert (scheduler["sigma_data"], scheduler["sigma_max"], scheduler["prediction_type"],
            scheduler["final_sigmas_type"]) == (0.5, 80.0, "epsilon", "sigma_min")
    config = CosmosTransformer3DModel.load_config(folder / "transformer")
    assert config["extra_pos_embed_type"] == "learnable" and config["concat_padding_mask"]
    assert tuple(config["rope_scale"]) == (2.0, 1.0, 1.0)
    vae = AutoencoderKLCosmos.from_pretrained(folder, subfolder="vae")
    assert len(vae.config.latents_mean) == 16 * 16
    assert vae.encode(torch.zeros(1, 3, 9, 64, 64)).latent_dist.mode().shape == (1, 16, 2, 8, 8)
    shard = next((folder / "transformer").glob("*-of-*.safetensors"))
    with safe_open(shard, "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16


@pytest.mark.parametrize("name,prefix", [("model.pt", "net."), ("comfy.safetensors", "")])
def test_single_files_in_nvidias_layout_load(folder, tmp_path, name, prefix):
    file = write_single_file(folder, tmp_path / name, prefix=prefix)
    spec = _spec(file, single_file_config=folder)
    spec.ensure_available()
    loaded = spec.load_denoiser(torch.float32).state_dict()
    reference = CosmosTransformer3DModel.from_pretrained(folder, subfolder="transformer").state_dict()
    assert set(loaded) == set(reference)
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    if name.endswith(".safetensors"):  # ComfyUI's file as city96's GGUF
        from tests.unit.test_gguf_files import assert_gguf_keeps_the_values

        assert_gguf_keeps_the_values(lambda path: _spec(path, single_file_config=folder), file,
                                     tmp_path)


def test_a_predict2_file_or_folder_is_refused_naming_what_it_is(folder, tmp_path):
    from dpipe.errors import ModelLoadError
    from dpipe.models.cosmos_predict2.tiny import make_tiny_cosmos_predict2
    from dpipe.models.cosmos_predict2.tiny import write_single_file as write_predict2_file

    predict2 = make_tiny_cosmos_predict2(tmp_path / "predict2")
    with pytest.raises(ModelLoadError, match=r"model_index.json names Cosmos2TextToImagePipeline.*"
                                             r"model=cosmos_predict2"):
        _spec(predict2).ensure_available()
    file = write_predict2_file(predict2, tmp_path / "predict2.safetensors")
    with pytest.raises(ModelLoadError, match=r"predict2.safetensors.*Cosmos-Predict2"):
        _spec(file, single_file_config=folder).load_denoiser(torch.float32)


def test_cosmos_predict2_refuses_a_cosmos1_folder(folder):
    from dpipe.config.compose import compose_run
    from dpipe.errors import ModelLoadError
    from dpipe.models.registry import build_spec

    spec = build_spec(compose_run(["model=tiny_cosmos_predict2", "dataset=synthetic",
                                   f"model.path={folder}"]).model)
    with pytest.raises(ModelLoadError, match=r"transformer/config.json.*Cosmos 1.0.*model=cosmos1"):
        spec.ensure_available()


def test_idempotent_and_the_cli_writes_the_folder(folder, tmp_path):
    stamps = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    assert make_tiny_cosmos1(folder) == folder
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == stamps
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model", REPO_ROOT / "scripts" / "make_tiny_model.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["cosmos1", str(tmp_path / "cli")]) == 0
    for rel in sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file()):
        assert (folder / rel).read_bytes() == (tmp_path / "cli" / rel).read_bytes(), rel
