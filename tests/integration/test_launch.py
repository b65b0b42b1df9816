"""Started by torchrun, dpipe uses the ranks it is given, and only rank 0 writes the run dir."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.cli import REPO, metrics, train_args

pytestmark = pytest.mark.slow


def test_torchrun_ranks_are_used_and_rank0_owns_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "dpipe.cli.train",
           *train_args(run_dir, "pipeline.stages=2", "pipeline.micro_batches=2",
                       "train.max_steps=2")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, DS_ACCELERATOR="cpu"), start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()
    # Hydra's record is written once, by rank 0 (other ranks compose with output_subdir=null).
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "starting" not in proc.stderr  # no workers of dpipe's own were started
