"""DeepSpeed checkpoints in the run dir, and finding the newest *complete* one.

A checkpoint is `<run_dir>/checkpoints/step_<N>/`. Every rank writes its part, then rank 0 adds
COMPLETE (atomically) once all ranks have finished; a folder without it is a checkpoint that was
interrupted and is never loaded. The run config is saved beside it, so a resume can compare.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from dpipe.io import atomic_write_text

MARKER = "COMPLETE"
PREFIX = "step_"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def tag_for(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.glob(f"{PREFIX}*"):
        if (path / MARKER).is_file():
            found.append((json.loads((path / MARKER).read_text())["step"], path))
    return sorted(found)


def newest_complete(run_dir: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def save(engine, run_dir: Path, step: int, config_yaml: str, lora: bool, keep: int) -> Path:
    root = checkpoint_root(run_dir)
    tag = tag_for(step)
    engine.save_checkpoint(
        str(root), tag=tag, client_state={"step": step}, exclude_frozen_parameters=lora
    )
    dist.barrier()
    path = root / tag
    if dist.get_rank() == 0:
        atomic_write_text(path / "config.yaml", config_yaml)
        atomic_write_text(path / MARKER, json.dumps({"step": step, "time": time.time()}))
        _prune(run_dir, keep)
    dist.barrier()
    return path


def load(engine, run_dir: Path, path: Path, lora: bool) -> int:
    _, client_state = engine.load_checkpoint(
        str(checkpoint_root(run_dir)), tag=path.name, load_module_strict=not lora
    )
    if client_state is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {path}")
    return int(client_state["step"])


def _prune(run_dir: Path, keep: int) -> None:
    complete = complete_checkpoints(run_dir)
    for _, path in complete[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    newest = complete[-1][0] if complete else -1
    # Interrupted checkpoints older than the newest complete one will never be used.
    for path in checkpoint_root(run_dir).glob(f"{PREFIX}*"):
        if not (path / MARKER).exists() and int(path.name[len(PREFIX):]) < newest:
            shutil.rmtree(path, ignore_errors=True)
