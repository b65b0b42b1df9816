"""Whether a .safetensors file is whole, read from its header alone (a few bytes to a few MB,
never the tensors): an empty file, one cut short (a download or copy that stopped) or one that
is no safetensors file at all is named with what it is and, when its header says, the size it
should have. Checked before any worker starts, where a loader's own error would name the file
without a reason, after every process had loaded its libraries."""

from __future__ import annotations

import json
from pathlib import Path

from dpipe.errors import ModelLoadError

HEADER_LENGTH_BYTES = 8  # a little-endian u64, then that many bytes of JSON
LARGEST_HEADER = 100_000_000  # safetensors' own limit on the JSON header


def file_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file `path`, or None when it is whole."""
    size = path.stat().st_size
    if size == 0:
        return "it is empty (0 bytes)"
    with open(path, "rb") as f:
        head = f.read(HEADER_LENGTH_BYTES)
        if len(head) < HEADER_LENGTH_BYTES:
            return f"it is cut short: {size} bytes, not even a safetensors header"
        length = int.from_bytes(head, "little")
        if length > LARGEST_HEADER:
            return "it is not a safetensors file (it does not start with a header length)"
        if HEADER_LENGTH_BYTES + length > size:
            return (f"it is cut short: {size} bytes, inside its header of "
                    f"{HEADER_LENGTH_BYTES + length} bytes")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "it is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "it is not a safetensors file (its header is not a JSON object)"
    try:
        end = max((entry["data_offsets"][1] for key, entry in header.items()
                   if key != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError):
        return "it is not a safetensors file (its header lists no tensor offsets)"
    expected = HEADER_LENGTH_BYTES + length + end
    if size < expected:
        return f"it is cut short: {size} bytes of the {expected} its header describes"
    return None


def check_file(path: Path, what: str) -> None:
    """Raises ModelLoadError naming `path` (`what` it is, e.g. "lora=") unless it is whole."""
    wrong = file_problem(path)
    if wrong is not None:
        fix = ("give a .safetensors file" if wrong.startswith("it is not") else
               "download or copy it again")
        raise ModelLoadError(f"{what}{path}: {wrong}; {fix}")


def check_folder_files(path: Path, what: str) -> None:
    """`check_file` of `path` (a .safetensors file) or of every .safetensors file under it."""
    if path.is_file():
        if path.suffix == ".safetensors":
            check_file(path, what)
        return
    if path.is_dir():
        for file in sorted(path.rglob("*.safetensors")):
            check_file(file, f"{what}{path}: its file ")
