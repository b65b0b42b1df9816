"""Runs `dpipe-train` as a user would: a real process tree, killed as a whole on timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
