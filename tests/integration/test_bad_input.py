"""A user's mistake ends with one clear message naming what to change, never a traceback."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.cli import dpipe_train, train_args

pytestmark = pytest.mark.slow


def _assert_user_error(result, *fragments):
    assert result.code == 2, f"expected exit 2, got {result.code}\n{result.out}\n{result.err}"
    assert "Traceback" not in result.err, result.err
    for fragment in fragments:
        assert fragment in result.err, f"{fragment!r} not in:\n{result.err}"


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
    assert "starting" not in result.out + result.err  # "run dir: ...; starting N worker processes"


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
    """FlexAttention has no backward pass on the CPU, cuDNN no CPU kernel: refused before the
    first step."""
    result = dpipe_train(*train_args(tmp_path / "run", f"model.attention={kernel}",
                                     "pipeline.compile=true"))
    _assert_user_error(result, f"model.attention={kernel} trains on a CUDA GPU only",
                       "model.attention=sdpa")
