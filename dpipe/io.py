"""Atomic file writes: a reader, or a run killed mid-write, never sees a partial file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Moves a finished folder into place, replacing an older one (the old one goes last)."""
    old = final_dir.with_name(f".{final_dir.name}.old")
    if old.exists():
        import shutil

        shutil.rmtree(old)
    if final_dir.exists():
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old.exists():
        import shutil

        shutil.rmtree(old)
