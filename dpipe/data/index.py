"""What reading each dataset file taught us, remembered so that the next start reads nothing.

Per file: its sha256 (the cache keys' source fingerprint) and a probe (image size, video frames
and rate, caption text, or the error it gave), stored under the file's (size, mtime_ns, ctime_ns).
A later start that sees the same three values reuses the record; any write to the file changes
its ctime (which no tool can set back, unlike mtime), so an edited file is always re-read.

One JSON file per dataset directory, in `<cache_dir>/sources/`, replaced atomically: concurrent
runs at worst each re-read a file, never read a half-written index.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from dpipe.data.captions import read_caption
from dpipe.data.sources import FoundFile, file_fingerprint
from dpipe.images import probe_image
from dpipe.data.audio import probe_audio
from dpipe.data.video import probe_video
from dpipe.errors import DataError
from dpipe.io import atomic_write_text

INDEX_VERSION = 2
INDEX_DIR = "sources"
# A record is stored flat, as [size, mtime_ns, ctime_ns, error or null, *FIELDS[kind]]: a 100k-file
# index then parses twice as fast as one small JSON object per file.
FIELDS = {"image": ("sha256", "w", "h"),
          "video": ("sha256", "w", "h", "frames", "fps", "duration", "audio"),
          "audio": ("sha256", "rate", "channels", "duration"),  # .wav/.flac next to a clip
          "text": ("text",)}


def _probe_text(path: str) -> dict:
    return {"text": read_caption(Path(path))}


PROBES: dict[str, Callable[[Path], dict]] = {
    "image": probe_image,
    "video": probe_video,
    "text": _probe_text,
    "audio": probe_audio,
}


class FileIndex:
    """The records of one directory's files, keyed by their path relative to it."""

    def __init__(self, cache_dir: Path, folder: Path):
        real = os.path.realpath(folder)
        name = hashlib.sha256(real.encode()).hexdigest()[:32]
        self.path = Path(cache_dir).expanduser() / INDEX_DIR / f"{name}.json"
        self.folder = real
        self._records: dict[str, list] = {}
        self._seen: set[str] = set()
        self._changed = False
        self.reads = 0  # files read (hashed and probed) by this instance: 0 on a warm start
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") == INDEX_VERSION and data.get("folder") == real:
                self._records = data["files"]
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # absent or unreadable: every file is read once more

    def records(self, files: list[FoundFile], kind: str, workers: int = 8) -> list[dict]:
        """The record of each file ({"sha256", ...probe}, or {"error"}), reading only new or
        changed files, in a thread pool (hashing and decoding headers release the GIL)."""
        out: list[dict | None] = []
        todo: list[int] = []
        fields = FIELDS[kind]
        for i, f in enumerate(files):
            self._seen.add(f.rel)
            cached = self._records.get(f.rel)
            # A record of fewer fields was written before a field was added (videos' "audio"):
            # that file is read again, once.
            if cached is not None and cached[:3] == f.stamp and (
                    cached[3] is not None or len(cached) == 4 + len(fields)):
                out.append({"error": cached[3]} if cached[3] is not None
                           else dict(zip(fields, cached[4:])))
            else:
                out.append(None)
                todo.append(i)
        if todo:
            with ThreadPoolExecutor(max(1, workers)) as pool:
                fresh = list(pool.map(lambda i: _read(files[i], kind), todo))
            for i, record in zip(todo, fresh):
                out[i] = record
                self._records[files[i].rel] = files[i].stamp + [record.get("error")] + (
                    [] if "error" in record else [record[k] for k in fields])
            self._changed = True
            self.reads += len(todo)
        return out  # type: ignore[return-value]

    def save(self) -> None:
        """Writes the records of the files seen this time (others have left the directory)."""
        stale = set(self._records) - self._seen
        if not self._changed and not stale:
            return
        for rel in stale:
            del self._records[rel]
        payload = {"version": INDEX_VERSION, "folder": self.folder, "files": self._records}
        atomic_write_text(self.path, json.dumps(payload, separators=(",", ":")))
        self._changed = False


def _read(f: FoundFile, kind: str) -> dict:
    try:
        record = {} if kind == "text" else {"sha256": file_fingerprint(f.path)}
        record.update(PROBES[kind](f.path))
        return record
    except DataError as error:
        return {"error": str(error)}
