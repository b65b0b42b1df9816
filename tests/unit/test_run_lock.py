"""The run-dir lock (dpipe.launch.run_lock): one holder, the holder named to a second run, and a
lock left by a dead run taken over, on this host (PID gone) and from another (stale heartbeat)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dpipe.launch import run_lock
from dpipe.launch.run_lock import LOCK_NAME, RunDirBusy, acquire, read_holder, this_process

REPO = Path(__file__).resolve().parents[2]


def _plant(run_dir: Path, age_s: float = 0.0, **changes) -> run_lock.Holder:
    """A lock of another run (this process's identity with `changes`), its heartbeat age_s old."""
    holder = dataclasses.replace(this_process(), token="planted", **changes)
    fields = {k: v for k, v in dataclasses.asdict(holder).items() if k != "heartbeat"}
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps(fields))
    beat = time.time() - age_s
    os.utime(path, (beat, beat))
    return holder


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_lock_is_taken_refuses_a_second_run_naming_the_holder_and_is_released(tmp_path):
    lock = acquire(tmp_path)
    stored = read_holder(tmp_path / LOCK_NAME)
    assert (stored.pid, stored.host) == (os.getpid(), lock.holder.host)
    with pytest.raises(RunDirBusy) as refused:
        acquire(tmp_path)
    message = str(refused.value)
    assert str(tmp_path) in message and f"PID {os.getpid()}" in message
    assert f"host {lock.holder.host}" in message and "since 20" in message
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    acquire(tmp_path).release()  # free again


def test_the_holder_refreshes_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    with acquire(tmp_path):
        path = tmp_path / LOCK_NAME
        os.utime(path, (time.time() - 300, time.time() - 300))
        time.sleep(0.5)
        assert time.time() - path.stat().st_mtime < 5


def test_a_lock_whose_process_is_gone_on_this_host_is_taken_over_and_said(tmp_path, caplog):
    dead = _plant(tmp_path, pid=_dead_pid())
    with caplog.at_level("WARNING", logger="dpipe"), acquire(tmp_path) as lock:
        assert read_holder(tmp_path / LOCK_NAME).token == lock.holder.token
    said = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(said) == 1 and f"PID {dead.pid}" in said[0] and "process is gone" in said[0]


def test_a_live_process_on_this_host_keeps_its_lock_even_with_an_old_heartbeat(tmp_path):
    # a hung run may still write: alive on this host means busy, whatever its heartbeat
    parent = _plant(tmp_path, age_s=600, pid=os.getppid(), pid_start="")
    with pytest.raises(RunDirBusy, match=f"PID {parent.pid}"):
        acquire(tmp_path)


def test_another_hosts_lock_is_kept_while_its_heartbeat_is_fresh_taken_over_once_stale(tmp_path,
                                                                                      caplog):
    _plant(tmp_path, age_s=5, host="gpu-node-17", pid=4242)
    with pytest.raises(RunDirBusy, match="host gpu-node-17, PID 4242"):
        acquire(tmp_path)
    _plant(tmp_path, age_s=run_lock.STALE_S + 30, host="gpu-node-17", pid=4242)
    with caplog.at_level("WARNING", logger="dpipe"), acquire(tmp_path) as lock:
        assert read_holder(tmp_path / LOCK_NAME).token == lock.holder.token
    assert any("took over" in r.getMessage() and "heartbeat stopped" in r.getMessage()
               for r in caplog.records)


def test_a_requeued_slurm_job_takes_over_its_earlier_attempts_lock_at_once(tmp_path, monkeypatch):
    # the earlier attempt ran on another node seconds ago: its heartbeat is fresh
    _plant(tmp_path, age_s=2, host="gpu-node-3", pid=4242, slurm_job_id="777",
           slurm_restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    acquire(tmp_path).release()
    # another job on the same run dir is refused
    _plant(tmp_path, age_s=2, host="gpu-node-3", pid=4242, slurm_job_id="776")
    with pytest.raises(RunDirBusy, match="SLURM job 776"):
        acquire(tmp_path)


def test_of_threads_starting_at_once_exactly_one_takes_the_lock(tmp_path):
    takers = 8
    start = threading.Barrier(takers)
    won, refused = [], []

    def take():
        start.wait()
        try:
            won.append(acquire(tmp_path))
        except RunDirBusy:
            refused.append(True)

    threads = [threading.Thread(target=take) for _ in range(takers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(won), len(refused)) == (1, takers - 1)
    won[0].release()


_TAKER = """
import sys, time
from pathlib import Path
from dpipe.launch.run_lock import RunDirBusy, acquire
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
try:
    lock = acquire(Path(sys.argv[1]))
except RunDirBusy:
    print("refused", flush=True)
else:
    print("won", flush=True)
    time.sleep(max(0.0, start + 1.5 - time.time()))  # the others see a live holder
"""


def test_of_processes_taking_over_one_dead_lock_at_once_exactly_one_wins(tmp_path):
    _plant(tmp_path, pid=_dead_pid())
    start = time.time() + 1.0  # after every interpreter has started
    takers = [subprocess.Popen([sys.executable, "-c", _TAKER, str(tmp_path), str(start)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(4)]
    outcomes = sorted(p.communicate(timeout=30)[0].strip() for p in takers)
    assert outcomes == ["refused", "refused", "refused", "won"]
    assert not (tmp_path / LOCK_NAME).exists()  # the winner released it at exit
