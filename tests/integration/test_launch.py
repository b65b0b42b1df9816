"""How dpipe's processes start and stop: started by torchrun, it uses the ranks it is given and
only rank 0 writes the run dir; started by dpipe itself, its workers never outlive the launcher."""

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
    # no workers of dpipe's own were started (the launcher logs "starting N worker processes"
    # to stdout, Hydra's log)
    assert "worker processes" not in proc.stdout + proc.stderr


def _descendants(pid: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found.update(children)
        todo.extend(children)
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has stopped; its new parent may not reap it


def test_workers_stop_when_the_launcher_is_killed(tmp_path):
    """SIGKILL gives the launcher no chance to stop its workers: they must notice themselves."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpipe.cli.train",
         *train_args(run_dir, "pipeline.stages=2", "pipeline.micro_batches=2",
                     "train.max_steps=100000", "train.checkpoint_every_steps=0")],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").is_file() or not metrics(run_dir):
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        workers = _descendants(proc.pid)
        assert len(workers) >= 3, workers  # the fork server and 2 workers
        proc.kill()  # the launcher alone
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if _running(pid)], "workers outlived the launcher"
        steps = len(metrics(run_dir))
        time.sleep(1)
        assert len(metrics(run_dir)) == steps, "training went on"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
