"""Runs `dpipe-train` as a user would: a real process tree, killed as a whole on timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    code: int
    out: str
    err: str


def train_args(run_dir: Path, *overrides: str) -> list[str]:
    return [f"hydra.run.dir={run_dir}", "train.progress_bar=false", *overrides]


def dpipe_train(*args: str, timeout: float = 240, cwd: Path | None = None) -> Result:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpipe.cli.train", *args],
        cwd=cwd or REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=dict(os.environ),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"dpipe-train timed out after {timeout}s\n{out}\n{err}") from None
    return Result(proc.returncode, out, err)


def train_killed_at(run_dir: Path, marker: str, *overrides: str, timeout: float = 240) -> None:
    """Starts `dpipe-train` on `run_dir` with `overrides` and kills its whole process tree
    (SIGKILL, no warning) the moment `run_dir / marker` exists (e.g. a checkpoint's COMPLETE)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpipe.cli.train", *train_args(run_dir, *overrides)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not (run_dir / marker).exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, f"no {marker} appeared"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every worker
    proc.wait()


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Sweep:
    """The points of one `dpipe-train -m hydra.sweep.dir=DIR ...` sweep.

    Runs that differ in a few overrides are one sweep: its points run one after another in one
    process, their workers forked by one fork server that imported the libraries once.
    """

    def __init__(self, sweep_dir: Path, *args: str, timeout: float = 1200):
        self.result = dpipe_train("-m", f"hydra.sweep.dir={sweep_dir}", *args, timeout=timeout)
        summary = sweep_dir / "sweep_summary.json"
        assert summary.is_file(), f"the sweep wrote no summary:\n{self.result.out}\n{self.result.err}"
        self.points = json.loads(summary.read_text())["points"]

    def run_dir(self, *overrides: str) -> Path:
        """The run dir of the point with these overrides (e.g. "model=tiny_flux"); fails, saying
        why, if that point did not complete."""
        point, = [p for p in self.points if set(overrides) <= set(p["overrides"])]
        assert point["status"] == "completed", (
            f"{' '.join(overrides)}: {point['status']}: {point['message']}\n"
            f"{self.result.err[-5000:]}")
        return Path(point["run_dir"])


def bench_rows(out: Path, runs: dict[str, str], *flags: str, timeout: float = 300) -> dict[str, dict]:
    """`dpipe-bench --size tiny` over `runs` ({name: overrides}): its result row per name."""
    args = [sys.executable, "-m", "dpipe.cli.bench", "--size", "tiny", "--warmup", "1",
            "--steps", "2", "--out", str(out), *flags]
    for name, overrides in runs.items():
        args += ["--run", f"{name}: {overrides}"]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())}
    assert [r.get("error") for r in rows.values()] == [None] * len(runs), done.stdout + done.stderr
    return rows
