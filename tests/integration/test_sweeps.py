"""Sweeps on this machine through `dpipe-train -m`: the sweep summary, a failed point that does not
stop the others, and points run in parallel by the submitit_local launcher."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dpipe.cli.train_help import EXAMPLES
from tests.cli import dpipe_train, metrics
from tests.integration.test_documented_commands import documented_command
from tests.integration.trained import run_config

pytestmark = pytest.mark.slow

BASE = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=2", "pipeline.micro_batches=4",
        "train.max_steps=2", "train.progress_bar=false"]


def summary(sweep_dir) -> list[dict]:
    return json.loads((sweep_dir / "sweep_summary.json").read_text())["points"]


def test_the_documented_sweep_runs_as_written(tmp_path):
    # README's and docs/cluster.md's sweep, as test_documented_commands maps it (one step per
    # point; that module leaves it to this test), and `dpipe-train --help`'s
    documented = documented_command(
        "dpipe-train -m optim.lr=1e-4,5e-5 model.lora.rank=16,32 train.max_steps=1")
    sweep = next(command for _, command in EXAMPLES if " -m " in command)
    assert sweep == "dpipe-train -m optim.lr=1e-4,5e-5 model.lora.rank=16,32"
    assert [*sweep.split()[1:], "train.max_steps=1"] == list(documented.args)
    result = dpipe_train(*documented.args, cwd=tmp_path, timeout=500)
    assert result.code == 0, result.out + result.err
    (sweep_dir,) = (tmp_path / "multirun" / "tiny_flux-synthetic").iterdir()  # <date>_<time>
    folders = ["0_rank=16,lr=0.0001", "1_rank=32,lr=0.0001", "2_rank=16,lr=5e-05",
               "3_rank=32,lr=5e-05"]  # every swept key, none of the fixed ones
    points = summary(sweep_dir)
    assert [Path(p["run_dir"]).name for p in points] == folders
    assert [p["status"] for p in points] == ["completed"] * 4
    for folder, (lr, rank) in zip(folders, [(1e-4, 16), (1e-4, 32), (5e-5, 16), (5e-5, 32)]):
        run = run_config(sweep_dir / folder)  # each point trained with its own values
        assert (run.optim.lr, run.model.lora.rank) == (lr, rank)
        assert metrics(sweep_dir / folder)[-1]["step"] == 1
        assert (sweep_dir / folder / "lora" / "pytorch_lora_weights.safetensors").is_file()
    md = (sweep_dir / "sweep_summary.md").read_text()
    assert "All points: train.max_steps=1" in md
    assert "| 3 | optim.lr=5e-05 model.lora.rank=32 | completed | 1 |" in md


def test_a_failed_point_is_reported_and_the_sweep_goes_on(tmp_path):
    # point 0 finds no model at model.path; point 1 creates the tiny model there and trains
    result = dpipe_train("-m", f"hydra.sweep.dir={tmp_path}", *BASE,
                         f"model.path={tmp_path}/model", "model.tiny=false,true", timeout=400)
    assert result.code == 1, result.out + result.err
    points = summary(tmp_path)
    assert [p["status"] for p in points] == ["failed", "completed"]
    assert f"{tmp_path}/model" in points[0]["message"]
    assert points[1]["metrics"]["step"] == 2 and points[1]["metrics"]["loss"] > 0
    md = (tmp_path / "sweep_summary.md").read_text()
    assert "| 1 | model.tiny=True | completed | 2 |" in md and "#0: failed:" in md
    assert md.strip() in result.out  # printed too
    assert "1 of 2 sweep points did not complete" in result.err


def test_local_parallel_sweep_runs_points_at_once(tmp_path):
    # conf/cluster/local_parallel.yaml's command, one key swept; two points at once on CI's 2 cores
    result = dpipe_train("cluster=local_parallel", "hydra.launcher.max_parallel=2",
                         "optim.lr=1e-4,5e-5", "train.max_steps=2", cwd=tmp_path, timeout=400)
    assert result.code == 0, result.out + result.err
    (sweep_dir,) = (tmp_path / "multirun" / "tiny_flux-synthetic").iterdir()
    log = result.out + result.err
    assert "2 at a time on CPU" in log
    assert re.search(r"sweep point #0 \(job \d+\): .*\n.*sweep point #1 \(job \d+\): ", log)
    # the two runs overlapped: each started (run.yaml) before the other one ended (its export)
    runs = [sweep_dir / f"{i}_lr={lr}" for i, lr in enumerate(["0.0001", "5e-05"])]
    starts = [(r / "run.yaml").stat().st_mtime for r in runs]
    ends = [(r / "lora" / "pytorch_lora_weights.safetensors").stat().st_mtime for r in runs]
    assert max(starts) < min(ends), (starts, ends)
    points = summary(sweep_dir)
    assert [p["status"] for p in points] == ["completed", "completed"]
    assert all((Path(p["run_dir"]) / "lora").is_dir() for p in points)
    assert [p["metrics"]["step"] for p in points] == [2, 2]
