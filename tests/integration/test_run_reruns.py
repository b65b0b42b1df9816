"""Running `dpipe-train` again on a run dir: a finished run says so and starts nothing; another
dataset is not resumed into the run's weights."""

from __future__ import annotations

from pathlib import Path

import pytest

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
