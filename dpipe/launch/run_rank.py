"""Runs training on one rank and turns user errors into a message instead of a traceback."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from dpipe.config.checks import validate
from dpipe.config.run_name import RUN_CONFIG
from dpipe.config.schema import RunConfig
from dpipe.errors import UserError
from dpipe.io import atomic_write_text
from dpipe.launch.quiet import disable_library_progress_bars, thread_locks_for_progress_bars

USER_ERROR_SIGNAL = signal.SIGUSR1  # worker -> local launcher: "I recorded a user error"  # the resolved config the run was started with


def save_run_config(run: RunConfig, run_dir: Path) -> None:
    atomic_write_text(run_dir / RUN_CONFIG, OmegaConf.to_yaml(OmegaConf.structured(run)))


def load_run_config(path: Path) -> RunConfig:
    return validate(OmegaConf.load(path), world_size=int(os.environ.get("WORLD_SIZE", "1")))


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[%(asctime)s %(name)s] %(message)s" if rank == 0 else f"[rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def exit_process(code: int) -> None:
    """Ends a rank's process now that its work is saved: runs the exit handlers, flushes, exits.

    Python's own shutdown of a process that has trained (freeing every module of torch, DeepSpeed,
    diffusers one by one) takes ~2 s of CPU per process and saves nothing: every file the run writes
    is already closed (checkpoints and exports are atomic, the metrics writer is closed).
    """
    import atexit

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def train_job(run: RunConfig, run_dir: Path) -> Callable[[], object]:
    def job():
        from dpipe.train.loop import run_training

        return run_training(run, run_dir)

    return job


def error_folders(run_dir: Path, launcher_pid: str) -> list[Path]:
    """Where the ranks of one launcher record their user errors, in order: the run dir's
    `.errors`, then a folder in the temp dir, for when the run dir's disk is the one that is
    full (a WriteFailed) and not even the message fits there."""
    return [Path(run_dir) / ".errors", Path(tempfile.gettempdir()) / f"dpipe-errors-{launcher_pid}"]


def _record(message: str, rank: int, folders: list[Path]) -> bool:
    for folder in folders:
        try:
            atomic_write_text(folder / f"rank{rank:05d}.txt", message)
            return True
        except OSError:
            continue
    return False


def run_rank(job: Callable[[], object], run_dir: Path) -> int:
    """Runs `job` as this rank (training: `train_job`; dpipe-sample's) and records its user
    errors in `run_dir`."""
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    disable_library_progress_bars()
    thread_locks_for_progress_bars()

    try:
        job()
    except UserError as err:
        # The launcher prints each distinct message once; a rank on its own prints it itself.
        launcher = os.environ.get("DPIPE_LAUNCHER_PID")
        if launcher is None or not _record(str(err), rank, error_folders(run_dir, launcher)):
            print(f"error: {err}", file=sys.stderr)
            if launcher is None:
                return 2
        # Tell the launcher before exiting: it stops every worker at once, before the others
        # notice this one's sockets closing and print tracebacks of a lost peer.
        os.kill(int(launcher), USER_ERROR_SIGNAL)
        time.sleep(30)
        return 2
    return 0
