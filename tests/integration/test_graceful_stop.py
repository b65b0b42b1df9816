"""A user's stop: SIGINT (Ctrl-C) or SIGTERM to `dpipe-train` finishes the step, checkpoints it and
exits with one line (130 / 143), leaving no process behind; the same command resumes from there.

The signal goes either to the launcher's PID alone (the launcher must pass it on to its workers,
a `kill PID` reaches no other process) or to the run's whole process group, as a terminal's
Ctrl-C, systemd, `scancel`, `timeout` and `kill -- -PGID` send it (the fork server and the workers
get it too). A stop before training started ends the run with one line, at any moment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from tests.cli import REPO, metrics, train_args

pytestmark = pytest.mark.slow

MAX_STEPS = 200  # far more than the run gets to: only the signal's checkpoint is written
ARGS = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=1",
        f"train.max_steps={MAX_STEPS}", "train.checkpoint_every_steps=0", "train.log_every=1"]


def _stop_when(run_dir: Path, logs: Path, signum: int, ready: Callable[[int], bool],
               group: bool = False) -> tuple[int, str]:
    """Starts a run in its own process group, sends `signum` to the launcher (to the whole group
    if `group`) once `ready(pid)`; returns the exit code and stderr, once no process of the group
    is left."""
    err_path = logs / f"{signal.Signals(signum).name}.err"
    with open(err_path, "w") as err, open(logs / "out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dpipe.cli.train", *train_args(run_dir, *ARGS)],
                                cwd=REPO, stdout=out, stderr=err, start_new_session=True,
                                env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while not ready(proc.pid):
            assert proc.poll() is None, f"the run ended first:\n{err_path.read_text()}"
            assert time.monotonic() < deadline, f"not ready to be stopped:\n{err_path.read_text()}"
            time.sleep(0.02)
        (os.killpg if group else os.kill)(proc.pid, signum)
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


def _stop_after_steps(run_dir: Path, logs: Path, signum: int, steps: int,
                      group: bool = False) -> tuple[int, str]:
    """Stops a run once metrics.jsonl has `steps` more lines than now."""
    before = _logged_steps(run_dir)
    return _stop_when(run_dir, logs, signum, lambda _: _logged_steps(run_dir) >= before + steps,
                      group)


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

    # To the whole group this time: the same result.
    code, err = _stop_after_steps(run_dir, tmp_path, signal.SIGTERM, steps=3, group=True)
    assert "resumed from" in err, err
    second = _assert_stopped_at_a_checkpoint(run_dir, code, err, signal.SIGTERM)
    assert second >= first + 3
    # Trained on from the first stop: each step once, none lost.
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, second + 1))


def _catches(signum: int) -> Callable[[int], bool]:
    """Whether process `pid` has a handler for `signum` (the kernel's SigCgt mask): dpipe-train
    installs one as its first step, long before its imports end."""
    def ready(pid: int) -> bool:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines()
                          if line.startswith("SigCgt:")), 16)
        return bool(caught >> (signum - 1) & 1)
    return ready


def _fork_server_started(pid: int) -> bool:
    """Whether the launcher `pid` has started the fork server of its workers (which imports
    torch, DeepSpeed and diffusers for seconds before it forks the first worker)."""
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and os.getpgid(int(proc.name)) == pid
                    and b"multiprocessing.forkserver" in (proc / "cmdline").read_bytes()):
                return True
        except (OSError, ProcessLookupError):
            continue
    return False


@pytest.mark.parametrize("signum, group, when", [
    (signal.SIGTERM, True, "importing"),  # was: killed without a word
    (signal.SIGTERM, False, "starting workers"),  # was: acknowledged, then every step trained
    (signal.SIGINT, True, "starting workers"),  # Ctrl-C; was: rc 1 and tracebacks
])
def test_a_stop_before_training_ends_the_run_with_one_line(tmp_path, signum, group, when):
    run_dir = tmp_path / "run"
    ready = _catches(signal.SIGTERM) if when == "importing" else _fork_server_started
    code, err = _stop_when(run_dir, tmp_path, signum, ready, group)
    name = signal.Signals(signum).name
    assert code == 128 + signum, f"exit code {code}:\n{err}"
    assert "Traceback" not in err and "Error" not in err, err
    last = err.strip().splitlines()[-1]
    if last == f"stopped on {name} before training started":
        assert not (run_dir / "checkpoints").exists(), err
    else:  # the workers had started: they stopped at the first step, checkpointed
        saved = run_dir / "checkpoints" / "step_00000001"
        assert last == f"stopped at step 1 on {name}: checkpoint {saved}; run the same command to resume", err
        assert (saved / "COMPLETE").is_file()
    assert _logged_steps(run_dir) <= 1, err
