"""Writes that every rank of a run takes part in (checkpoints, exports).

A write that fails on any rank (a full disk, a quota, a read-only place) fails on every rank
with the same WriteFailed: a rank that raised alone would leave the others waiting forever in
the next collective, and each rank's message would name only its own part.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from dpipe.io import WriteFailed, free_bytes, is_write_error, write_failure


def write_together(write: Callable[[], object], what: str, path: Path, needed: int,
                   partial: list[Path], what_is_left: Callable[[int], str],
                   joins_barrier: bool = False) -> None:
    """Runs this rank's part of writing `what` at `path` (`write`, which may do nothing on this
    rank); then every rank learns whether any rank's part failed (one gather). On a failure,
    rank 0 removes the `partial` folders and every rank raises WriteFailed: the OS's reason (or
    the `needed` bytes against those free), then `what_is_left(failed_rank)`.

    `joins_barrier`: `write` has barriers of its own (DeepSpeed's save): a rank whose write
    failed joins the last one, where the others wait.
    """
    failure = None
    try:
        write()
    except Exception as error:  # noqa: BLE001 - every write error, reported by every rank below
        if not (is_write_error(error) or free_bytes(path) < needed):
            raise
        failure = (dist.get_rank(), write_failure(what, path, needed, error))
        if joins_barrier:
            dist.barrier()
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    failures = [f for f in failures if f is not None]
    if not failures:
        return
    if dist.get_rank() == 0:
        for folder in partial:  # never loaded nor mistaken for a finished one: space back
            shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    rank, message = failures[0]
    raise WriteFailed(f"{message}. {what_is_left(rank)}")
