"""The default run name: another dataset folder is another run; the same folder, the same run."""

from __future__ import annotations

import hashlib

import pytest

from dpipe.config.compose import compose_config, compose_run
from dpipe.launch.run_rank import save_run_config
from tests.cli import dpipe_train


def name_of(*overrides: str) -> str:
    return compose_config(list(overrides)).name


def test_a_folder_dataset_is_named_by_its_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert name_of() == "tiny_flux-synthetic"  # the demo's run dir, as before
    assert name_of("model=tiny_wan", "dataset=folder", "dataset.path=/data/clips/") == \
        "tiny_wan-clips"
    assert name_of("dataset=photos_and_clips") == "tiny_flux-photos_and_clips"  # several folders
    assert name_of("dataset=folder") == "tiny_flux-folder"  # no path yet: the checks say so
    assert name_of("dataset=folder", "dataset.path=/data/photos", "name=mine") == "mine"


def test_two_folders_of_one_name_get_a_run_dir_each(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = tmp_path / "a" / "photos", tmp_path / "b" / "photos"
    for folder in (first, second):
        folder.mkdir(parents=True)
    args = ["dataset=folder", "dataset.resolutions=[64]"]
    assert name_of(*args, f"dataset.path={first}") == "tiny_flux-photos"
    run = compose_run([*args, f"dataset.path={first}"])
    save_run_config(run, tmp_path / "outputs" / "tiny_flux-photos")  # the first folder's run

    digest = hashlib.sha256(str(second).encode()).hexdigest()[:6]
    assert name_of(*args, f"dataset.path={second}") == f"tiny_flux-photos-{digest}"
    assert name_of(*args, f"dataset.path={first}/") == "tiny_flux-photos"  # the same folder
    (tmp_path / "outputs" / f"tiny_flux-photos-{digest}").mkdir()
    (tmp_path / "outputs" / "tiny_flux-photos" / "run.yaml").unlink()
    assert name_of(*args, f"dataset.path={second}") == f"tiny_flux-photos-{digest}"  # found again


@pytest.mark.slow
def test_cfg_job_prints_the_run_name_resolved(tmp_path):
    proc = dpipe_train("--cfg", "job", "dataset=folder", "dataset.path=/data/photos",
                       cwd=tmp_path, timeout=120)
    assert proc.code == 0, proc.err
    assert proc.out.startswith("name: tiny_flux-photos\n")
    assert "\n  path: /data/photos\n" in proc.out
