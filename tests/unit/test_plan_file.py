"""<run>/plan.json's host prediction: the launcher's plan figure where it wrote one, else each
worker's estimate; every launch starts a fresh record (one process, a gloo group of one)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from dpipe.pipeline.memory import PROCESS_HOST
from dpipe.train import plan_file


@pytest.fixture()
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_the_launchers_plan_figure_stays_and_a_new_launch_starts_afresh(group, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    layer = torch.nn.Linear(256, 256)  # 257 KiB of fp32 weights: read, then once in transit
    estimate = 2 * (256 * 256 + 256) * 4 + PROCESS_HOST
    plan_file.write_launch_prediction(run_dir, [10], 20, [12345])  # a GPU launch's plan
    plan_file.record_start(run_dir, [layer], [layer], stage_only=True)
    predicted = json.loads((run_dir / "plan.json").read_text())["predicted"]
    assert predicted == {"gpu_peak_per_stage": [10], "cache_disk": 20,
                         "host_peak_per_process": [12345]}
    plan_file.write_launch_prediction(run_dir, None, None)  # a launch without GPUs: no plan
    plan_file.record_start(run_dir, [layer], [layer], stage_only=True)
    predicted = json.loads((run_dir / "plan.json").read_text())["predicted"]
    assert predicted["host_peak_per_process"] == [estimate]
