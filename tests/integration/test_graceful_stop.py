"""A user's stop: SIGINT (Ctrl-C) or SIGTERM to `dpipe-train` finishes the step, checkpoints it and
exits with one line (130 / 143), leaving no process behind; the same command resumes from there.

The signal goes to the launcher's PID alone: the launcher must forward it to its workers (a
terminal's Ctrl-C would reach them too, a `kill PID` would not).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import REPO, metrics, train_args

pytestmark = pytest.mark.slow

MAX_STEPS = 200  # far more than the run gets to: only the signal's checkpoint is written
ARGS = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=1",
        f"train.max_steps={MAX_STEPS}", "train.checkpoint_every_steps=0", "train.log_every=1"]


def _stop_after_steps(run_dir: Path, logs: Path, signum: int, steps: int) -> tuple[int, str]:
    """Starts a run in its own process group, sends `signum` to the launcher once metrics.jsonl
    has `steps` more lines than now; returns the exit code and stderr, once no process of the group
    is left."""
    before = _logged_steps(run_dir)
    err_path = logs / f"{signal.Signals(signum).name}.err"
    with open(err_path, "w") as err, open(logs / "out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dpipe.cli.train", *train_args(run_dir, *ARGS)],
                                cwd=REPO, stdout=out, stderr=err, start_new_session=True,
                                env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while _logged_steps(run_dir) < before + steps:
            assert proc.poll() is None, f"the run ended first:\n{err_path.read_text()}"
            assert time.monotonic() < deadline, f"no steps logged:\n{err_path.read_text()}"
            time.sleep(0.02)
        os.kill(proc.pid, signum)
        code = proc.wait(timeout=60)
        deadline = time.monotonic() + 5
        while True:  # the fork server and the workers end with the launcher
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "a process of the run outlived the launcher"
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, err_path.read_text()


def _logged_steps(run_dir: Path) -> int:
    """Complete lines of metrics.jsonl (the last one may be half written)."""
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _assert_stopped_at_a_checkpoint(run_dir: Path, code: int, err: str, signum: int) -> int:
    name = signal.Signals(signum).name
    assert code == 128 + signum, f"exit code {code}:\n{err}"
    assert "Traceback" not in err, err
    step = metrics(run_dir)[-1]["step"]
    assert step < MAX_STEPS
    saved = run_dir / "checkpoints" / f"step_{step:08d}"
    assert (saved / "COMPLETE").is_file(), f"no complete checkpoint of step {step}:\n{err}"
    assert err.strip().splitlines()[-1] == (
        f"stopped at step {step} on {name}: checkpoint {saved}; run the same command to resume")
    assert not (run_dir / "lora").exists(), "an unfinished run wrote its final export"
    return step


def test_a_signal_checkpoints_the_step_and_the_same_command_resumes(tmp_path):
    run_dir = tmp_path / "run"
    code, err = _stop_after_steps(run_dir, tmp_path, signal.SIGINT, steps=3)
    first = _assert_stopped_at_a_checkpoint(run_dir, code, err, signal.SIGINT)

    code, err = _stop_after_steps(run_dir, tmp_path, signal.SIGTERM, steps=3)
    assert "resumed from" in err, err
    second = _assert_stopped_at_a_checkpoint(run_dir, code, err, signal.SIGTERM)
    assert second >= first + 3
    # Trained on from the first stop: each step once, none lost.
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, second + 1))
