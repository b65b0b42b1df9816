"""A video LoRA on a folder of images and clips with the defaults a user gets: the command as a
user types it (plus a step count) trains the clips as clips, in frame buckets chosen from them
and named in the dataset report, beside the images (which never share a VAE call with a clip).

One run per family: Wan (4k+1 frames), and LTX-2 (8k+1) with model.audio=true, whose clips'
sound is trained.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli import dpipe_train, metrics
from tests.integration.trained import cached_dataset
from tests.unit.test_data_support import write_clips_with_sound

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    # Two 9-frame clips at 8 fps with sound on their track, two images, all captioned.
    return write_clips_with_sound(tmp_path_factory.mktemp("clips_and_images"), 9, 8)


@pytest.mark.parametrize("model", [("model=tiny_wan",), ("model=tiny_ltx2", "model.audio=true")],
                         ids=["wan", "ltx2-audio"])
def test_a_folder_of_images_and_clips_trains_its_clips_by_default(model, folder, tmp_path):
    result = dpipe_train(*model, "dataset=folder", f"dataset.path={folder}",
                         "dataset.resolutions=[64]", "train.max_steps=1", cwd=tmp_path,
                         timeout=400)
    assert result.code == 0, result.out + result.err[-5000:]
    run_dir, = (p.parent for p in (tmp_path / "outputs").glob("*/run.yaml"))
    assert [m["step"] for m in metrics(run_dir)] == [1]

    report = (run_dir / "data" / "report-train.txt").read_text()
    assert f"note: frame buckets [1, 9] chosen from the 2 clip(s) of {folder}" in report
    assert "warning" not in report, report  # every sample trains; the clips' sound too
    dataset, plan = cached_dataset(run_dir)
    buckets = {b.name: b for b in plan.manifest.buckets}
    assert sorted(buckets) == ["64x64", "64x64x9f"]
    assert sorted(Path(s.source).name for s in buckets["64x64x9f"].samples) == [
        "clip0.mp4", "clip1.mp4"]
    assert plan.steps_per_epoch == 1  # the one step trained both buckets, all 4 samples
    if "model.audio=true" in model:
        assert all(s.audio for s in buckets["64x64x9f"].samples)
