"""Running `dpipe-train` again on a run dir: a finished run says so and starts nothing; another
dataset is not resumed into the run's weights, and by default is another run dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpipe.data.synthetic import draw_shape
from tests.cli import dpipe_train, train_args

pytestmark = pytest.mark.slow

RUN = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=1", "train.max_steps=2"]


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file a started run writes or rewrites."""
    paths = [run_dir / "metrics.jsonl", *(run_dir / "tensorboard").iterdir(),
             *(run_dir / "lora").iterdir(), *(run_dir / "checkpoints").rglob("*")]
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in paths if p.is_file()}


def test_a_finished_run_says_so_and_another_dataset_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    first = dpipe_train(*train_args(run_dir, *RUN))
    assert first.code == 0, f"{first.out}\n{first.err}"
    before = _snapshot(run_dir)

    again = dpipe_train(*train_args(run_dir, *RUN))
    assert again.code == 0, f"{again.out}\n{again.err}"
    line, = again.out.strip().splitlines()
    assert line.startswith(f"{run_dir} is complete at step 2: its outputs are in {run_dir / 'lora'}")
    assert "`train.max_steps=M` (M > 2) to continue it" in line and "`name=...`" in line
    assert "starting 1 worker processes" not in again.err  # no worker started...
    assert _snapshot(run_dir) == before  # ...and none rewrote the metrics, events or export

    other = tmp_path / "other_shapes"
    refused = dpipe_train(*train_args(run_dir, *RUN, f"dataset.path={other}"))
    assert refused.code == 2, f"{refused.out}\n{refused.err}"
    assert "Traceback" not in refused.err
    assert "it trained on another dataset" in refused.err
    assert f"dataset folders now: {other}" in refused.err
    assert "name=tiny_flux-synthetic-other_shapes" in refused.err
    assert _snapshot(run_dir) == before


def test_a_lora_on_another_folder_of_the_same_name_is_a_new_run(tmp_path):
    """The default name, `<model>-<folder name>`: the second folder called photos gets a run dir
    of its own (a hash of its path added) instead of a refused resume of the first one's."""
    folders = [tmp_path / "a" / "photos", tmp_path / "b" / "photos"]
    for n, folder in enumerate(folders):
        folder.mkdir(parents=True)
        for i in range(4):
            image, caption = draw_shape(10 * n + i, 64)
            image.save(folder / f"{i}.png")
            (folder / f"{i}.txt").write_text(caption)
    outputs = tmp_path / "outputs"
    for folder in folders:
        result = dpipe_train("dataset=folder", f"dataset.path={folder}", "dataset.resolutions=[64]",
                             "train.max_steps=1", cwd=tmp_path)
        assert result.code == 0, f"{result.out}\n{result.err}"
    first, second = sorted(outputs.iterdir())
    assert first.name == "tiny_flux-photos" and second.name.startswith("tiny_flux-photos-")
    for run_dir in (first, second):
        assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()
