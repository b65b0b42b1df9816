"""A user's mistake ends with one clear message naming what to change, never a traceback."""

from __future__ import annotations

import shutil

import pytest
import torch
from PIL import Image

from tests.cli import dpipe_command, dpipe_train, train_args

pytestmark = pytest.mark.slow


def _assert_user_error(result, *fragments):
    assert result.code == 2, f"expected exit 2, got {result.code}\n{result.out}\n{result.err}"
    assert "Traceback" not in result.err, result.err
    for fragment in fragments:
        assert fragment in result.err, f"{fragment!r} not in:\n{result.err}"


def _assert_no_worker_started(result):
    # The launcher logs "run dir: ...; starting N worker processes" (Hydra's log: stdout).
    assert "worker processes" not in result.out + result.err, result.out + result.err


def test_missing_model_path(tmp_path):
    result = dpipe_train(*train_args(tmp_path / "run", "model=flux", "model.path=/nonexistent/FLUX"))
    _assert_user_error(result, "model.path=/nonexistent/FLUX does not exist")


def test_incomplete_model_folder(tmp_path):
    folder = tmp_path / "FLUX.1-dev"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text("{}")
    result = dpipe_train(*train_args(tmp_path / "run", "model=flux", f"model.path={folder}"))
    _assert_user_error(result, "not a complete FLUX.1 diffusers folder", "vae", "text_encoder_2")


def test_empty_dataset_folder(tmp_path):
    empty = tmp_path / "photos"
    empty.mkdir()
    result = dpipe_train(*train_args(tmp_path / "run", "dataset=folder", f"dataset.path={empty}",
                                     "dataset.resolutions=[64]"))
    _assert_user_error(result, str(empty))


def test_a_missing_prompts_file_stops_before_any_worker(tmp_path):
    result = dpipe_train(*train_args(tmp_path / "run", f"sample.prompts_file={tmp_path}/p.txt"))
    _assert_user_error(result, f"sample.prompts_file={tmp_path}/p.txt: no such file")
    _assert_no_worker_started(result)


def test_a_prompt_split_at_an_unquoted_comma_shows_in_the_log(tmp_path):
    """Hydra reads `[sks style, a red ball]` as two prompts: the log lists them as read (this
    run then stops at its missing dataset folder, before any worker)."""
    result = dpipe_train(*train_args(tmp_path / "run", "sample.prompts=[sks style, a red ball]",
                                     "dataset=folder", f"dataset.path={tmp_path}/photos"))
    _assert_user_error(result, f"{tmp_path}/photos")
    assert "sample prompts: 'sks style' | 'a red ball'" in result.out + result.err


def test_unreadable_image_in_strict_mode(tmp_path):
    """(Without dataset.strict, unreadable files are skipped with a warning listing them:
    tests/unit/test_data_bad_input.py.)"""
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(4):
        Image.new("RGB", (64, 64), (40 * i, 0, 0)).save(folder / f"ok{i}.png")
        (folder / f"ok{i}.txt").write_text("a red square")
    (folder / "broken.png").write_bytes(b"this is not an image")
    (folder / "broken.txt").write_text("a broken file")
    result = dpipe_train(*train_args(tmp_path / "run", "dataset=folder", f"dataset.path={folder}",
                                     "dataset.resolutions=[64]", "dataset.strict=true"))
    _assert_user_error(result, "broken.png")


@pytest.mark.parametrize("kernel", ["flex", "cudnn"])
def test_a_gpu_attention_kernel_on_the_cpu(tmp_path, kernel):
    """FlexAttention has no backward pass on the CPU, cuDNN no CPU kernel: refused before any
    worker starts."""
    result = dpipe_train(*train_args(tmp_path / "run", f"model.attention={kernel}",
                                     "pipeline.compile=true"))
    _assert_user_error(result, f"model.attention={kernel} trains on a CUDA GPU only",
                       "model.attention=sdpa")
    _assert_no_worker_started(result)


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    """A tiny FLUX.1 folder of this test's own, to damage copies of."""
    from dpipe.config.schema import ModelConfig
    from dpipe.models.registry import build_spec

    folder = tmp_path_factory.mktemp("models") / "tiny-flux"
    build_spec(ModelConfig(family="flux", path=str(folder), tiny=True)).ensure_available()
    return folder


def test_a_cut_short_model_file_is_named_with_its_size_before_any_worker(tiny_flux, tmp_path):
    model = tmp_path / "FLUX"
    shutil.copytree(tiny_flux, model)
    shard = sorted((model / "transformer").glob("*.safetensors"))[0]
    whole = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: whole // 2])
    result = dpipe_train(*train_args(tmp_path / "run", "model=flux", f"model.path={model}"))
    _assert_user_error(result, f"{shard}: it is cut short: {whole // 2} bytes of the {whole} "
                               "its header describes")
    _assert_no_worker_started(result)


def test_a_lora_file_that_is_not_whole_is_named_in_one_line(tmp_path):
    """dpipe-sample's `lora=`: an empty file, one cut short and one that is no safetensors."""
    from safetensors.torch import save_file

    whole = tmp_path / "whole.safetensors"
    save_file({"a": torch.zeros(64)}, whole)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole.read_bytes()[:-100])
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    other = tmp_path / "weights.ckpt"
    torch.save({"a": torch.zeros(4)}, other)
    for lora, why in ((empty, "it is empty (0 bytes); download or copy it again"),
                      (cut, f"it is cut short: {cut.stat().st_size} bytes of the "
                            f"{whole.stat().st_size} its header describes; download or copy it "
                            "again"),
                      (other, "it is not a safetensors file (it does not start with a header "
                              "length); give a .safetensors file")):
        done = dpipe_command("dpipe-sample", "model=tiny_flux", f"lora={lora}",
                             "sample.prompts=[a cat]", f"out={tmp_path}")
        assert done.code == 2, done.err[-3000:]
        assert done.err.strip().splitlines() == [f"error: lora={lora}: {why}"], done.err[-3000:]


def test_a_symlink_loop_in_the_dataset_is_named_in_strict_mode(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(4):
        Image.new("RGB", (64, 64), (40 * i, 0, 0)).save(folder / f"ok{i}.png")
        (folder / f"ok{i}.txt").write_text("a red square")
    (folder / "again").symlink_to(folder)
    result = dpipe_train(*train_args(tmp_path / "run", "dataset=folder", f"dataset.path={folder}",
                                     "dataset.resolutions=[64]", "dataset.strict=true"))
    _assert_user_error(result, f"{folder / 'again'}: a symlink loop")


def test_a_resolution_below_the_pixel_multiple_is_refused_before_any_worker(tiny_flux, tmp_path):
    result = dpipe_train(*train_args(tmp_path / "run", "model=flux", f"model.path={tiny_flux}",
                                     "dataset.resolutions=[7]"))
    _assert_user_error(result, "dataset.resolutions=[7]: 7 is smaller than the model's pixel "
                               "multiple 8")
    _assert_no_worker_started(result)
