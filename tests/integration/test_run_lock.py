"""One training process group per run dir, through real `dpipe-train` processes: a second run on a
busy run dir stops naming the holder; the lock of a run killed with SIGKILL is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cli import REPO, dpipe_train, train_args

pytestmark = pytest.mark.slow

# Enough steps that the first run is still training when it is killed.
RUN = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=1",
       "train.checkpoint_every_steps=0"]


def test_a_second_run_on_a_busy_run_dir_stops_and_a_killed_runs_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "dpipe.cli.train",
         *train_args(run_dir, *RUN, "train.max_steps=100000")],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():
            assert first.poll() is None, f"the first run ended ({first.returncode}) before a step"
            assert time.monotonic() < deadline, "the first run wrote no metrics"
            time.sleep(0.05)

        hydra_files = {p: p.stat().st_mtime_ns for p in (run_dir / ".hydra").glob("*.yaml")}
        assert len(hydra_files) == 3  # config, hydra, overrides: written under the lock
        second = dpipe_train(*train_args(run_dir, *RUN, "train.max_steps=100000",
                                         "optim.lr=5e-5"))
        assert second.code == 2, f"exit {second.code}\n{second.out}\n{second.err[-3000:]}"
        assert first.poll() is None, "the first run ended: the refusal proves nothing"
        error = [line for line in second.err.splitlines() if line.startswith("error: ")]
        assert len(error) == 1 and f"{run_dir} is in use" in error[0], second.err
        assert f"PID {first.pid}" in error[0] and "host " in error[0] and "since " in error[0]
        assert "starting" not in second.out + second.err  # no worker started
        # Nothing of the refused run is written: Hydra's record is still the first run's.
        assert {p: p.stat().st_mtime_ns for p in hydra_files} == hydra_files
        assert "optim.lr" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the launcher and every worker, with no warning
        first.wait()

    third = dpipe_train(*train_args(run_dir, *RUN, "train.resume=false", "train.max_steps=1"))
    assert third.code == 0, f"exit {third.code}\n{third.out}\n{third.err[-3000:]}"
    log = third.out + third.err
    assert f"took over the lock of {run_dir}" in log and f"PID {first.pid}" in log, log
    assert "process is gone" in log
    assert not (run_dir / ".lock").exists()  # released at exit
