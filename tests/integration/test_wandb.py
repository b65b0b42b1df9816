"""train.loggers=[tensorboard, jsonl, wandb], offline (no network): rank 0's wandb run holds
the run config and TensorBoard's scalars at their steps, and a resume continues the same wandb
run. The run's records are read from wandb's own file (a leveldb-style log of protobuf
records, tests/integration/wandb_records.py)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.cli import dpipe_train, metrics, train_args
from tests.integration.wandb_records import config, history, run_files

pytestmark = pytest.mark.slow

RUN = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=2", "train.max_steps=4",
       "train.checkpoint_every_steps=2", "train.loggers=[tensorboard,jsonl,wandb]",
       "train.wandb.mode=offline"]


def test_wandb_mirrors_the_runs_scalars_and_config_and_a_resume_continues_it(tmp_path):
    run_dir = tmp_path / "run"
    os.environ.setdefault("WANDB_SILENT", "true")
    result = dpipe_train(*train_args(run_dir, *RUN))
    assert result.code == 0, result.err[-3000:]
    run_id = (run_dir / "wandb_id").read_text().strip()
    [first] = run_files(run_dir, run_id)
    loss = history(first, "train/loss")
    assert loss == {m["step"]: pytest.approx(m["loss"]) for m in metrics(run_dir)}
    held = config(first)
    assert held["model"]["family"] == "flux" and held["train"]["max_steps"] == 4, held.keys()

    # A resume from step 2: the same wandb run id, continued from step 3.
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    shutil.rmtree(run_dir / "lora")
    result = dpipe_train(*train_args(run_dir, *RUN))
    assert result.code == 0, result.err[-3000:]
    assert (run_dir / "wandb_id").read_text().strip() == run_id
    files = run_files(run_dir, run_id)
    assert len(files) == 2
    assert sorted(history(files[-1], "train/loss")) == [3, 4]


@pytest.mark.parametrize("loggers, message", [
    ("[tensorboard]", "train.loggers must keep jsonl"),
    ("[jsonl,wandb]", "needs tensorboard too"),
])
def test_logger_lists_that_cannot_work_are_refused(tmp_path, loggers, message):
    result = dpipe_train(*train_args(tmp_path / "run", f"train.loggers={loggers}"))
    assert result.code == 2 and message in result.err, result.err[-2000:]
