"""Identity of a model component's files, for cache keys.

Every byte of every file is hashed (sha256): a fingerprint of samples misses an edit between
them, and the cache then serves tensors made by the old weights. Hashing a 20 GB model at every
start would cost a minute or more, so each file's digest is remembered, as the dataset index
(`dpipe.data.index`) remembers a media file's, under the file's (size, mtime_ns, ctime_ns,
inode): a start that sees all four unchanged reads nothing. Any write to a file changes its
ctime, which no tool can set back (unlike mtime); a file replaced by another (a copy, a download
renamed into place, a re-pointed hub symlink) has another inode.

One JSON index per folder, in `$DPIPE_CACHE/weights/` (default `~/.cache/dpipe/weights/`): one
model serves every dataset's `cache_dir`. It is replaced atomically, so concurrent runs at worst
each hash a file again, never read a half-written index; an index that cannot be written costs
only the time of hashing again at the next start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dpipe.errors import ModelLoadError
from dpipe.io import atomic_write_text

log = logging.getLogger(__name__)

INDEX_VERSION = 1
INDEX_DIR = "weights"
_CHUNK = 8 << 20
_unwritable_warned = False


def dpipe_cache() -> Path:
    """dpipe's own cache folder: `$DPIPE_CACHE`, by default `~/.cache/dpipe` (as the configs'
    `${oc.env:DPIPE_CACHE,...}` paths name it)."""
    base = os.environ.get("DPIPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "dpipe")
    return Path(base).expanduser()


def index_dir() -> Path:
    """Where the digest indexes live: beside the default latent cache (`dataset.cache_dir`)."""
    return dpipe_cache() / INDEX_DIR


def sha256_of(path: str | Path) -> str:
    """The sha256 hex digest of every byte of the file."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)  # one buffer, refilled: no 8 MB allocation per read
    view = memoryview(buffer)
    try:
        with open(path, "rb", buffering=0) as file:
            if hasattr(os, "posix_fadvise"):  # a larger read-ahead: the disk reads while we hash
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := file.readinto(buffer):
                digest.update(view[:n])  # releases the GIL: files hash on several cores
    except OSError as error:
        raise ModelLoadError(f"cannot read {path} ({error}): check that it exists and is "
                             "readable.") from None
    return digest.hexdigest()


class DigestIndex:
    """The remembered sha256 of each file of one folder, keyed by its path relative to it;
    a record is [size, mtime_ns, ctime_ns, inode, sha256]."""

    def __init__(self, folder: str | Path):
        self.folder = os.path.realpath(folder)
        name = hashlib.sha256(self.folder.encode()).hexdigest()[:32]
        self.path = index_dir() / f"{name}.json"
        self.files_read = 0  # files hashed by this instance: 0 when every stamp matched
        self._records: dict[str, list] = {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") == INDEX_VERSION and data.get("folder") == self.folder:
                self._records = data["files"]
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # absent or unreadable: every file is hashed once more

    def digests(self, rels: list[str], prune: bool) -> list[str]:
        """The sha256 of each file, hashing only those whose stamp changed (several at once);
        `prune` forgets the files not in `rels` (those that left a folder listed whole)."""
        paths = [os.path.join(self.folder, rel) for rel in rels]
        stamps = []
        for path in paths:
            try:
                st = os.stat(path)  # taken before reading: a write during the read shows next time
            except OSError as error:
                raise ModelLoadError(f"cannot read {path} ({error}): check that it exists and "
                                     "is readable.") from None
            stamps.append([st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
        out: list[str | None] = []
        todo: list[int] = []
        for i, (rel, stamp) in enumerate(zip(rels, stamps)):
            record = self._records.get(rel)
            if isinstance(record, list) and len(record) == 5 and record[:4] == stamp:
                out.append(record[4])
            else:
                out.append(None)
                todo.append(i)
        gone = set(self._records) - set(rels) if prune else set()
        if todo:
            workers = max(1, min(4, os.cpu_count() or 1, len(todo)))
            with ThreadPoolExecutor(workers) as pool:
                fresh = list(pool.map(lambda i: sha256_of(paths[i]), todo))
            for i, digest in zip(todo, fresh):
                out[i] = digest
                self._records[rels[i]] = stamps[i] + [digest]
            self.files_read += len(todo)
        for rel in gone:
            del self._records[rel]
        if todo or gone:
            self._save()
        return out  # type: ignore[return-value]

    def _save(self) -> None:
        global _unwritable_warned
        payload = {"version": INDEX_VERSION, "folder": self.folder, "files": self._records}
        try:
            atomic_write_text(self.path, json.dumps(payload, separators=(",", ":")))
        except OSError as error:
            if not _unwritable_warned:
                _unwritable_warned = True
                log.warning("cannot write the model files' digest index %s (%s): the next "
                            "start hashes them again; set DPIPE_CACHE to a writable folder.",
                            self.path, error)


def file_fingerprint(path: Path) -> str:
    """The sha256 of one file (a single-file checkpoint), remembered in its folder's index."""
    path = Path(path)
    return DigestIndex(path.parent).digests([path.name], prune=False)[0]


def folder_fingerprint(folder: Path) -> str:
    """Fingerprint of every file in a component folder (weights, config, tokenizer files):
    their paths and the sha256 of all their bytes."""
    folder = Path(folder)
    rels = [str(p.relative_to(folder)) for p in sorted(p for p in folder.rglob("*")
                                                        if p.is_file())]
    h = hashlib.sha256()
    for rel, digest in zip(rels, DigestIndex(folder).digests(rels, prune=True)):
        h.update(rel.encode())
        h.update(digest.encode())
    return h.hexdigest()
