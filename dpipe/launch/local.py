"""Starts the worker processes of a run on this machine: one per GPU, or CPU processes (gloo).

The user never types torchrun or deepspeed. Each worker runs `python -m dpipe.launch.worker
<run_dir>`, reading the resolved config that the launcher saved there. If any worker fails, the
others are stopped (they would wait forever in a collective) and the user errors they recorded are
reported once each.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dpipe.config.schema import RunConfig
from dpipe.errors import ConfigError
from dpipe.launch.run_rank import USER_ERROR_SIGNAL

ERRORS_DIR = ".errors"


def world_size_for(run: RunConfig, gpus: int) -> int:
    stages, dp = run.pipeline.stages, run.pipeline.data_parallel
    if gpus == 0:
        return stages * (dp or 1)
    if dp is None:
        if gpus < stages:
            raise ConfigError(f"pipeline.stages={stages} needs at least {stages} GPUs; found {gpus}")
        dp = gpus // stages
    if stages * dp > gpus:
        raise ConfigError(
            f"pipeline.stages x pipeline.data_parallel = {stages * dp} GPUs, but {gpus} are visible"
        )
    return stages * dp


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(run_dir: Path, world_size: int, module: str = "dpipe.launch.worker") -> int:
    """Runs the workers to completion; returns 0, or the exit code of the first that failed."""
    errors = run_dir / ERRORS_DIR
    for old in errors.glob("*.txt") if errors.exists() else []:
        old.unlink()
    port = free_port()
    base_env = dict(os.environ)
    if not any(k in base_env for k in ("DS_ACCELERATOR",)) and not _has_gpu():
        base_env["DS_ACCELERATOR"] = "cpu"  # skips DeepSpeed's probing (and its warning)
    procs = []
    for rank in range(world_size):
        env = dict(base_env, DPIPE_LAUNCHER="local", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", module, str(run_dir)],
            env=env,
        ))
    user_error = []
    previous = signal.signal(USER_ERROR_SIGNAL, lambda *_: user_error.append(True))
    try:
        code = _wait(procs, user_error)
    except BaseException:
        _stop(procs)
        raise
    finally:
        signal.signal(USER_ERROR_SIGNAL, previous)
    if code:
        _stop(procs)
        _report_errors(errors)
    return code


def _wait(procs, user_error: list) -> int:
    while True:
        if user_error:
            return 2
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)  # they may be blocked in a collective: no grace needed
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _report_errors(errors: Path) -> None:
    seen = []
    for path in sorted(errors.glob("*.txt")) if errors.exists() else []:
        message = path.read_text().strip()
        if message and message not in seen:
            seen.append(message)
    for message in seen:
        print(f"error: {message}", file=sys.stderr)
