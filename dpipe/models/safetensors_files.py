"""Whether a .safetensors file is whole, read from its header alone (a few bytes to a few MB,
never the tensors): an empty file, one cut short (a download or copy that stopped) or one that
is no safetensors file at all is named with what it is and, when its header says, the size it
should have. Checked before any worker starts, where a loader's own error would name the file
without a reason, after every process had loaded its libraries. And chosen tensors of a file,
read one by one (`read_tensors`): a pipeline stage loads its own weights and no others."""

from __future__ import annotations

import json
from pathlib import Path

import torch

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


def file_header(file: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """({tensor: its header entry}, the metadata) of a safetensors file, nothing else read."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(HEADER_LENGTH_BYTES), "little")
        header = json.loads(f.read(length))
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata


# safetensors' dtype names -> torch's (the formats diffusers folders hold).
TENSOR_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool}


def read_tensors(path: Path, wanted: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """The tensors of `path` named in `wanted`, each read on its own and cast to its dtype there:
    the host holds the tensors asked for and one more in transit. Read with plain file reads, not
    mapped: a mapped file's pages count in the process's memory while it stays open."""
    out = {}
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(HEADER_LENGTH_BYTES), "little")
        header = json.loads(f.read(length))
        start = HEADER_LENGTH_BYTES + length
        for key in sorted(wanted, key=lambda k: header[k]["data_offsets"][0]):
            entry = header[key]
            begin, end = entry["data_offsets"]
            raw = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(start + begin)
            f.readinto(memoryview(raw.numpy()))
            stored = raw.view(TENSOR_DTYPES[entry["dtype"]]).reshape(entry["shape"])
            out[key] = stored.to(wanted[key])
    return out
