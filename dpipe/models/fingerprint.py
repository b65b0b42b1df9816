"""Identity of a model component's files, for cache keys.

Hashing a 10 GB text encoder at every start is too slow, and size + mtime alone misses a
fine-tune copied over another. Small files are hashed whole; large ones by their safetensors
header (names, shapes, dtypes) plus evenly spaced samples of the data.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WHOLE_FILE_LIMIT = 64 << 20
SAMPLES = 32
SAMPLE_BYTES = 1 << 20


def file_fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        if size <= WHOLE_FILE_LIMIT:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            for i in range(SAMPLES):
                f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def folder_fingerprint(folder: Path) -> str:
    """Fingerprint of every file in a component folder (weights, config, tokenizer files)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode())
        h.update(file_fingerprint(path).encode())
    return h.hexdigest()
