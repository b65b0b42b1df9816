"""Which dpipe wrote a tiny model folder, so that one written by another dpipe is written again.

A tiny model is written once and then read by every run that names it (`model.tiny=true`,
`conf/model/tiny_*.yaml`). Its bytes come from the tiny writers' code and the libraries that save
it (diffusers writes its version into every config), so a folder written by another dpipe can
differ from what this one writes: a tiny FLUX.1 from before cc18215 (2026-12-07) has a VAE that
does not encode colours, and the demo trained on it samples noise without any error. Each folder
therefore holds a stamp, `dpipe-tiny.json`: the writer's name and a digest of the code that
decides the bytes (every module of `dpipe.models`, the versions of torch, diffusers, transformers,
tokenizers and safetensors). `tiny_parts.write_once` and the specs' `ensure_available` write a
folder again where `needs_writing` says so.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from dpipe.models.fingerprint import dpipe_cache

STAMP = "dpipe-tiny.json"
# The libraries whose versions change a tiny model's files (configs carry `_diffusers_version`
# and `transformers_version`; tokenizer files follow tokenizers').
LIBRARIES = ("torch", "diffusers", "transformers", "tokenizers", "safetensors")


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over every `dpipe.models` source file (path and bytes) and the library versions."""
    from importlib.metadata import PackageNotFoundError, version

    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for name in LIBRARIES:
        try:
            digest.update(f"{name}={version(name)}\0".encode())
        except PackageNotFoundError:
            digest.update(f"{name}=none\0".encode())
    return digest.hexdigest()


def read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None


def write_stamp(folder: Path, writer: str) -> None:
    (folder / STAMP).write_text(json.dumps({"writer": writer, "code": code_digest()}, indent=2)
                                + "\n")


def needs_writing(folder: Path) -> bool:
    """Whether a `model.tiny` folder must be written (again): it is missing, or stamped by
    another dpipe, or unstamped in dpipe's own cache (`owned_by_dpipe`)."""
    folder = Path(folder)
    if not folder.exists():
        return True
    stamped = read_stamp(folder)
    if stamped is not None:
        return stamped.get("code") != code_digest()
    return owned_by_dpipe(folder)


def owned_by_dpipe(folder: Path) -> bool:
    """Whether `folder` lies in dpipe's cache of tiny models (`$DPIPE_CACHE/models/`, by default
    `~/.cache/dpipe/models/`), where the configs put them: a folder there without a stamp was
    written by a dpipe from before the stamp, and may be written again. Elsewhere a folder without
    one may be the user's own, and is never replaced."""
    return Path(folder).resolve().parent == (dpipe_cache() / "models").resolve()
