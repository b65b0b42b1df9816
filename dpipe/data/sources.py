"""Dataset files: finding media files, fingerprinting a file (images are read by dpipe.images).

A directory holds images (every format Pillow opens) and videos (see `video.py`), mixed, found
recursively. Hidden files and folders (names starting with ".") are skipped: they are editor, OS
or tool leftovers (macOS `._cat.png`, `.ipynb_checkpoints/`), not data. Captions are in
`captions.py`; masks and control images are same-stem files in folders of their own.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from PIL import Image

from dpipe.data.audio import AUDIO_EXTENSIONS
from dpipe.errors import DataError

CAPTION_SUFFIX = ".txt"
VIDEO_EXTENSIONS = frozenset({".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v", ".mpg", ".mpeg",
                              ".wmv", ".flv", ".ts", ".3gp", ".ogv"})
_MAX_LISTED = 10  # files named in one error message


class FoundFile(NamedTuple):
    """A file seen by a directory walk, with the stat fields that tell whether it changed.
    (A tuple, and `path` a str: a start-up builds one per file, 100k of them.)"""

    path: str
    rel: str  # POSIX path relative to the walked directory
    size: int
    mtime_ns: int
    ctime_ns: int

    @property
    def stamp(self) -> list[int]:
        return [self.size, self.mtime_ns, self.ctime_ns]


@dataclass
class Listing:
    """A directory walk: media files by kind, and every same-stem candidate (captions, ...)."""

    root: Path
    images: list[FoundFile]
    videos: list[FoundFile]
    texts: dict[str, FoundFile]  # rel path without suffix -> its .txt file
    # rel path without suffix -> its .wav/.flac file (a clip's sound, for audio-video models)
    audio: dict[str, FoundFile] = field(default_factory=dict)
    # (path, why) of entries the walk cannot follow: symlink loops, links that cannot be resolved
    unfollowable: list[tuple[str, str]] = field(default_factory=list)


@functools.lru_cache(maxsize=None)
def image_extensions() -> frozenset[str]:
    """Lower-case suffixes (".png", ...) of every format this Pillow install can open."""
    extensions = Image.registered_extensions()  # also loads every format plugin
    readable = {ext for ext, fmt in extensions.items() if fmt in Image.OPEN}
    # MPO (multi-picture JPEG) has no opener of its own: Pillow's JPEG opener reads it.
    readable |= {ext for ext, fmt in extensions.items() if fmt == "MPO"}
    return frozenset(ext.lower() for ext in readable) - VIDEO_EXTENSIONS


def check_directory(folder: Path, what: str = "dataset directory") -> Path:
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise DataError(f"{what} {folder} does not exist: check the path in the dataset config.")
    if not folder.is_dir():
        raise DataError(f"{what} {folder} is a file: give a folder of images or videos.")
    return folder


def walk(folder: Path, exclude: tuple[Path, ...] = ()) -> Listing:
    """Every visible file under `folder`, sorted by relative path, one stat per file.

    `exclude` names folders inside `folder` that are not data (a mask folder kept next to the
    images, say).
    """
    folder = check_directory(folder)
    excluded = {os.path.realpath(p) for p in exclude}
    images, videos, texts, audio, unfollowable = [], [], {}, {}, []
    image_ext = image_extensions()
    # Each folder with the real paths of the folders above it: a link to one of them is a loop.
    stack = [(str(folder), "", frozenset([os.path.realpath(folder)]))]
    while stack:
        path, prefix, above = stack.pop()
        try:
            entries = list(os.scandir(path))
        except OSError as error:
            raise DataError(f"cannot list {path} ({error}): check its permissions.") from None
        for entry in entries:
            if entry.name.startswith("."):
                continue
            rel = prefix + entry.name
            try:
                is_dir = entry.is_dir()
            except OSError as error:  # a link to itself, or a chain of links too long
                unfollowable.append((entry.path, f"a link that cannot be followed "
                                                 f"({error.strerror})"))
                continue
            if is_dir:
                real = os.path.realpath(entry.path)
                if real in above:
                    unfollowable.append((entry.path, f"a symlink loop (a link to {real}, a "
                                                     "folder it is inside)"))
                elif real not in excluded:
                    stack.append((entry.path, rel + "/", above | {real}))
                continue
            dot = entry.name.rfind(".")
            suffix = entry.name[dot:].lower() if dot > 0 else ""
            kind = ("image" if suffix in image_ext else "video" if suffix in VIDEO_EXTENSIONS
                    else "text" if suffix == CAPTION_SUFFIX
                    else "audio" if suffix in AUDIO_EXTENSIONS else None)
            if kind is None or not entry.is_file():
                continue
            st = entry.stat()
            found = FoundFile(entry.path, rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if kind == "text":
                texts[rel[: -len(CAPTION_SUFFIX)]] = found
            elif kind == "audio":  # .wav before .flac when both are there
                stem = os.path.splitext(rel)[0]
                if stem not in audio or suffix == AUDIO_EXTENSIONS[0]:
                    audio[stem] = found
            else:
                (images if kind == "image" else videos).append(found)
    images.sort(key=lambda f: f.rel)
    videos.sort(key=lambda f: f.rel)
    return Listing(folder, images, videos, texts, audio, unfollowable)


def same_stem_files(folder: Path) -> dict[str, FoundFile]:
    """Images in a mask/control folder by relative path without suffix (`sub/cat`)."""
    listing = walk(folder)
    found: dict[str, FoundFile] = {}
    for f in listing.images:
        found.setdefault(os.path.splitext(f.rel)[0], f)
    return found


def list_files(files: list[Path]) -> str:
    """Up to _MAX_LISTED paths, one per line, and how many more."""
    listed = "\n  ".join(str(p) for p in files[:_MAX_LISTED])
    more = len(files) - _MAX_LISTED
    return "\n  " + listed + (f"\n  ... and {more} more" if more > 0 else "")


# --- fingerprints ------------------------------------------------------------------------------


def file_fingerprint(path: Path) -> str:
    """The sha256 hex digest of the file's bytes (the index in `index.py` avoids re-hashing
    files whose size, mtime and ctime are unchanged)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as error:
        raise DataError(f"cannot read {path} ({error}): check that it exists and is readable.")
    return digest.hexdigest()
