"""A content-addressed store of tensor dicts (cached latents, text embeddings) on disk.

An entry's key is a hash of everything that determines its content (`cache_key`): the source
file's fingerprint, the encoder, the resolution, ... A changed input therefore gives a new key
and is recomputed; nothing is ever invalidated in place. Entries are safetensors files (no
pickle), written atomically, so any number of processes may fill the same store at once and a
killed writer never leaves a partial file under an entry's name.

Each entry carries a CRC-32 of its tensors (names, dtypes, shapes and bytes) in its metadata,
checked on every read: a flipped bit or a file cut short is a `DamagedEntry`, never data. CRC-32
(zlib, no dependency) detects every single-bit error and every burst of up to 32 bits, which is
what a disk fault or a cut-short copy makes, at 2.8-3.6 GiB/s on one core of an H100 host: a
1024^2 FLUX sample's ~9 MiB costs ~3 ms, in the training loader's worker processes on GPU
(docs/performance.md).
Entries written before checksums existed (no `dpipe.crc32` in their metadata) are read unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dpipe.errors import DataError
from dpipe.io import WriteFailed, is_write_error, write_failure

# Part of every key. Bump it whenever the encoding of entries changes (what is stored, how
# images are preprocessed or encoded, tensor names or layouts): old entries then stop matching
# and are recomputed, instead of being loaded as if they were made by the new code.
CACHE_FORMAT_VERSION = 2  # 2: aspect/frame buckets, masks, controls

SUFFIX = ".safetensors"
CHECKSUM = "dpipe.crc32"  # the metadata field holding `checksum(tensors)`
_KEY = re.compile(r"[0-9a-f]{64}")
_NAME_LENGTH = 64 + len(SUFFIX)


class DamagedEntry(DataError):
    """A cache entry that cannot be read or whose tensors do not match their checksum."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"cache entry {path} is damaged ({reason})")


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 (8 hex digits) of the tensors' names, dtypes, shapes and bytes, in name order."""
    crc = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        crc = zlib.crc32(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode(), crc)
        if not tensor.is_contiguous():  # loaded and prepared tensors are; a caller's may not be
            tensor = tensor.contiguous()
        crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def cache_key(**parts: Any) -> str:
    """The sha256 hex digest of the parts (and CACHE_FORMAT_VERSION) as canonical JSON.

    Values may be str, int, float, bool, None, lists (tuples count as lists) and dicts with str
    keys, nested; the order of dict keys does not matter.
    """
    return KeyMaker()(**parts)


class KeyMaker:
    """`cache_key` for many entries that share some parts (the encoder, the crop, ...): the shared
    parts are hashed once, so a dataset of 100k files gets its keys in a fraction of a second.

    `KeyMaker(**shared)(**own)` and `KeyMaker(**other_shared)(**other_own)` never collide unless
    both the shared and the own parts are equal; `cache_key(**p)` is `KeyMaker()(**p)`.
    """

    def __init__(self, **shared: Any):
        _check_json_value(shared, "shared")
        self._prefix = hashlib.sha256(
            _canonical({"cache_format_version": CACHE_FORMAT_VERSION, "shared": shared}))

    def __call__(self, **parts: Any) -> str:
        _check_json_value(parts, "parts")
        digest = self._prefix.copy()
        digest.update(b"\0")
        digest.update(_canonical(parts))
        return digest.hexdigest()

    def fields(self, *values: str | int | float | None) -> str:
        """A key from values in a fixed order (for callers that make many keys of one kind):
        the same uniqueness as `__call__`, at a fraction of the cost, as long as no value but
        the last contains the separator "\\x1f" (hex digests, names and numbers do not)."""
        digest = self._prefix.copy()
        digest.update(b"\0fields\0")
        digest.update("\x1f".join(map(str, values)).encode("utf-8"))
        return digest.hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(
        value,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,  # NaN and inf have no JSON form; a key must never depend on one
    ).encode("utf-8")


class TensorStore:
    """Entries at `root/<first 2 key chars>/<key>.safetensors`; the prefix folders keep each
    directory small enough to list quickly on cluster filesystems."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path_for(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"not a cache key (64 lower-case hex digits from cache_key): {key!r}")
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def has(self, key: str) -> bool:
        return self.path_for(key).is_file()

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """The entry's tensors, verified against their checksum; None if it is absent.

        Raises `DamagedEntry` if it cannot be read or does not match (only possible from outside
        dpipe: a disk fault, a copy cut short, an edit; our writes are atomic). The entry is
        left in place: `put` replaces it, `dpipe-cache verify --remove` removes it."""
        read = self._read(key)
        return None if read is None else read[0]

    def verify(self, key: str) -> bool | None:
        """True if the entry matches its checksum, False if it has none (written before dpipe
        wrote checksums), None if it is absent; raises `DamagedEntry` as `get` does."""
        read = self._read(key)
        return None if read is None else read[1]

    def _read(self, key: str) -> tuple[dict[str, torch.Tensor], bool] | None:
        path = self.path_for(key)
        try:
            with safe_open(path, framework="pt") as file:
                stored = (file.metadata() or {}).get(CHECKSUM)
                tensors = {name: file.get_tensor(name) for name in file.keys()}
        except FileNotFoundError:
            return None
        except (SafetensorError, OSError, ValueError, RuntimeError) as error:
            raise DamagedEntry(path, f"unreadable: {error}") from None
        if stored is not None and checksum(tensors) != stored:
            raise DamagedEntry(path, "its tensors do not match their checksum")
        return tensors, stored is not None

    def put(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        metadata: dict[str, str] | None = None,
    ) -> None:
        """Store `tensors` under `key`, replacing any entry there (same key, same content)."""
        path = self.path_for(key)
        prepared = {name: _own_contiguous_cpu(name, tensor) for name, tensor in tensors.items()}
        if metadata is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise TypeError(f"safetensors metadata must map str to str, got {metadata!r}")
        metadata = {**(metadata or {}), CHECKSUM: checksum(prepared)}

        # Hidden and unique per writer: concurrent writers never share a temp file, and a listing
        # of `*.safetensors` never shows one.
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(prepared, tmp, metadata=metadata)
            # Flush to disk before the rename: otherwise a power cut can leave the new name
            # pointing at a file whose data never reached the disk.
            with open(tmp, "r+b") as file:
                os.fsync(file.fileno())
            os.replace(tmp, path)  # atomic: readers see the old entry or the whole new one
        except BaseException as error:
            tmp.unlink(missing_ok=True)
            if not is_write_error(error):
                raise
            # No byte count: an entry is small, and its size beside the free bytes would read
            # as if it fitted (the disk's own blocks and the file's header count too).
            raise WriteFailed(
                f"{write_failure('the cache entry', path, 0, error)}. The entries written "
                "so far are kept: the same command goes on from them once there is space, or "
                f"set `dataset.cache_dir=` to a folder on a larger disk (now {self.root})"
            ) from None


    def keys(self) -> set[str]:
        """Every entry's key, from one listing per prefix folder (no per-entry stat)."""
        found: set[str] = set()
        try:
            prefixes = [e for e in os.scandir(self.root) if e.is_dir() and len(e.name) == 2]
        except FileNotFoundError:
            return found
        for prefix in prefixes:
            # Names are "<64 hex>.safetensors"; temp files start with "." and are skipped.
            found.update(name[:64] for name in os.listdir(prefix.path)
                         if len(name) == _NAME_LENGTH and name[0] != "." and name.endswith(SUFFIX))
        return found

    def metadata(self, key: str) -> dict[str, str]:
        """The entry's metadata, from its header only (no tensor data is read)."""
        with safe_open(self.path_for(key), framework="pt") as file:
            return dict(file.metadata() or {})

    def remove(self, key: str) -> int:
        """Deletes an entry; returns the bytes freed (0 if it was absent)."""
        path = self.path_for(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        return size

    def writer(self, threads: int = 8) -> "StoreWriter":
        return StoreWriter(self, threads)


class StoreWriter:
    """`put`s entries from a thread pool: each write ends with an fsync, which costs milliseconds
    per file on its own but overlaps well (the disk commits concurrent syncs together). Use as a
    context manager; leaving it waits for every write and re-raises the first failure."""

    def __init__(self, store: TensorStore, threads: int):
        self.store = store
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="cache-write")
        self._pending: list[Future] = []
        self._limit = threads * 4  # bounds the tensors held in memory while waiting

    def put(self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None):
        self._pending.append(self._pool.submit(self.store.put, key, tensors, metadata))
        if len(self._pending) >= self._limit:
            self._drain(self._limit // 2)

    def _drain(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.pop(0).result()

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._drain(0)
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _own_contiguous_cpu(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy with storage of its own.

    safetensors refuses tensors that share storage (two names for one tensor, views of one
    buffer); a copy costs little for cache-sized tensors and makes every input valid.
    """
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a cache entry maps str to torch.Tensor, got {name!r}: {type(tensor)}")
    return tensor.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)


def _check_json_value(value: Any, where: str) -> None:
    """Refuse values whose JSON form would be ambiguous or that json.dumps would not take."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_json_value(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for name, item in value.items():
            # json.dumps would turn 1 into "1", so {1: x} and {"1": x} would share a key.
            if not isinstance(name, str):
                raise TypeError(f"cache key part {where} has a non-str key {name!r}")
            _check_json_value(item, f"{where}[{name!r}]")
        return
    raise TypeError(
        f"cache key part {where} is a {type(value).__name__}; use str, int, float, bool, None, "
        "list or dict (e.g. str() a Path, a file_fingerprint() for a file's content)."
    )
