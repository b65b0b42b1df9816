"""Atomic file writes: a reader, or a run killed mid-write, never sees a partial file."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from dpipe.errors import UserError


def _file_mode() -> int:
    """The mode `open` gives a new file (0o666 less the umask). mkstemp's files are 0o600: an
    export or config written through it would be unreadable to the rest of a team (or to a
    ComfyUI running as another user). The umask is read, not set: setting it is process-wide."""
    try:
        with open("/proc/self/status") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = 0o022
    return 0o666 & ~umask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    atomic_write(path, write)


def atomic_write(path: Path, write) -> Path:
    """`write(temporary path)` (a writer that takes a file name: safetensors', gguf's), then the
    file moved to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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


class WriteFailed(UserError):
    """A file could not be written (a full disk, a quota, a read-only place); the message names
    the path, the bytes needed and free, and what is left intact."""


_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def is_write_error(error: BaseException) -> bool:
    """An error of a write: an OSError, the RuntimeError that torch.save's C++ writer raises
    on a full disk ("basic_ios::clear: iostream error", "file write failed"), or safetensors'
    SafetensorError ("I/O error: No space left on device (os error 28)")."""
    if isinstance(error, OSError):
        return True
    from safetensors import SafetensorError

    return isinstance(error, (RuntimeError, SafetensorError)) and any(
        s in str(error) for s in ("iostream error", "write failed", "No space left",
                                  "unexpected pos", "I/O error"))


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of `path` (or of its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def show_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _exact(n: int) -> str:
    """`show_bytes` with the byte count beside a rounded size ("1.5 MiB (1572864 bytes)")."""
    shown = show_bytes(n)
    return shown if shown.endswith(" bytes") else f"{shown} ({n} bytes)"


def write_failure(what: str, path: Path, needed: int, error: BaseException) -> str:
    """One message for a failed write of `what` at `path`: the disk is full (or the write needed
    more than is free) with the bytes needed and free, or the OS's reason."""
    free = free_bytes(path)
    full = getattr(error, "errno", None) in _DISK_FULL_ERRNOS or (needed and free < needed) \
        or any(s in str(error) for s in ("iostream error", "write failed", "No space left"))
    if full:
        needs = f"it needs about {_exact(needed)}, " if needed else ""
        return (f"no space left to write {what} {path}: {needs}{_exact(free)} are free there. "
                "Free some space (or point the run at a larger disk)")
    reason = getattr(error, "strerror", None) or str(error)
    return f"cannot write {what} {path} ({reason}): check that the place is writable"
