"""Dataset files: finding media files, decoding and fitting an image, fingerprinting a file.

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

import numpy as np
import torch
from PIL import Image, ImageOps

from dpipe.data.audio import AUDIO_EXTENSIONS
from dpipe.errors import DataError

CAPTION_SUFFIX = ".txt"
VIDEO_EXTENSIONS = frozenset({".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v", ".mpg", ".mpeg",
                              ".wmv", ".flv", ".ts", ".3gp", ".ogv"})
_MAX_LISTED = 10  # files named in one error message
# EXIF orientations that turn the picture by 90 degrees (the stored width is the shown height).
_TRANSPOSED = {5, 6, 7, 8}


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


# --- images ------------------------------------------------------------------------------------


def probe_image(path: Path) -> dict:
    """{"w", "h"} as shown (EXIF rotation applied), from the header only; raises DataError."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            if image.getexif().get(0x0112) in _TRANSPOSED:
                width, height = height, width
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise DataError(f"cannot read image {path} ({error}): replace or delete the file.") from error
    return {"w": width, "h": height}


def open_rgb(path: Path) -> Image.Image:
    """The decoded image, upright, as 8-bit RGB; raises DataError naming the file."""
    try:
        with Image.open(path) as image:
            image.load()  # decode now, so a truncated file fails here rather than later
            image = ImageOps.exif_transpose(image)  # phone photos store rotation in EXIF
            return _to_rgb(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise DataError(f"cannot read image {path} ({error}): replace or delete the file.") from error


def open_mask(path: Path) -> Image.Image:
    """A mask image as 8-bit grey (white: full weight), upright."""
    try:
        with Image.open(path) as image:
            image.load()
            image = ImageOps.exif_transpose(image)
            if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "RGBA", "LA", "P"):
                image = _to_rgb(image)
            return image.convert("L")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise DataError(f"cannot read mask {path} ({error}): replace or delete the file.") from error


def fit(image: Image.Image, width: int, height: int,
        resample: Image.Resampling = Image.Resampling.LANCZOS) -> Image.Image:
    """Scale to cover width x height, keeping the aspect ratio, and keep the centre.

    The crop box is taken in source pixels and resized in one step: the same result as resizing
    then cropping, with a single resampling and no rounding of an intermediate size.
    """
    src_w, src_h = image.size
    scale = max(width / src_w, height / src_h)
    box_w, box_h = width / scale, height / scale
    left, top = (src_w - box_w) / 2, (src_h - box_h) / 2
    return image.resize((width, height), resample, box=(left, top, left + box_w, top + box_h))


def crop_top_left(src_w: int, src_h: int, width: int, height: int) -> tuple[int, int]:
    """(top, left) of the window `fit` keeps, in pixels of the source scaled to cover width x
    height: SDXL's crop coordinates (the image resized to cover the target, then cropped)."""
    scale = max(width / src_w, height / src_h)
    return round((src_h * scale - height) / 2), round((src_w * scale - width) / 2)


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB image -> float32 (3, H, W) in [-1, 1]."""
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8))  # (H, W, 3), a writable copy
    return (pixels.permute(2, 0, 1).float() / 127.5 - 1.0).contiguous()


def load_image(path: Path, width: int, height: int | None = None) -> torch.Tensor:
    """The image at `path` fitted to width x height (square if no height), (3, H, W) in [-1, 1]."""
    return to_tensor(fit(open_rgb(path), width, width if height is None else height))


def crop_fraction(src_w: int, src_h: int, width: int, height: int) -> float:
    """The share of the source image that `fit` to width x height cuts away."""
    a, b = src_w / src_h, width / height
    return 1.0 - min(a, b) / max(a, b)


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


def _to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB; transparent pixels become white, as on a typical page or viewer."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # Pillow's own conversion clips 16-bit values to 255, turning the image nearly white.
        levels = np.asarray(image, dtype=np.float64) / 257.0
        image = Image.fromarray(np.clip(np.rint(levels), 0, 255).astype(np.uint8), "L")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # palette transparency is lost by a direct RGB conversion
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
