"""Dataset files: finding images and their captions, decoding an image, fingerprinting a file.

A folder dataset is every image under a folder (recursively) with a same-stem `.txt` caption next
to it (`cat.png` -> `cat.txt`). Hidden files and folders (names starting with ".") are skipped:
they are editor, OS or tool leftovers (macOS `._cat.png`, `.ipynb_checkpoints/`), not data.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from dpipe.errors import DataError

CAPTION_SUFFIX = ".txt"
_MAX_LISTED = 10  # files named in one error message


@dataclass(frozen=True)
class ImageItem:
    path: Path
    caption: str


@functools.lru_cache(maxsize=None)
def image_extensions() -> frozenset[str]:
    """Lower-case suffixes (".png", ...) of every format this Pillow install can open."""
    extensions = Image.registered_extensions()  # also loads every format plugin
    readable = {ext for ext, fmt in extensions.items() if fmt in Image.OPEN}
    # MPO (multi-picture JPEG) has no opener of its own: Pillow's JPEG opener reads it.
    readable |= {ext for ext, fmt in extensions.items() if fmt == "MPO"}
    return frozenset(ext.lower() for ext in readable)


def scan_image_folder(folder: Path) -> list[ImageItem]:
    """Every image under `folder` with its caption, sorted by path."""
    folder = Path(folder)
    if not folder.exists():
        raise DataError(f"dataset folder {folder} does not exist: check dataset.path.")
    if not folder.is_dir():
        raise DataError(f"dataset.path {folder} is a file: set it to a folder of images.")

    extensions = image_extensions()
    images = sorted(
        (
            path
            for path in folder.rglob("*")
            if path.suffix.lower() in extensions
            and not _is_hidden(path.relative_to(folder))
            and path.is_file()
        ),
        key=lambda path: path.relative_to(folder).as_posix(),
    )
    if not images:
        raise DataError(
            f"dataset folder {folder} has no images. Accepted extensions: "
            + " ".join(sorted(extensions))
        )

    uncaptioned = [path for path in images if not path.with_suffix(CAPTION_SUFFIX).is_file()]
    if uncaptioned:
        listed = "\n  ".join(str(path) for path in uncaptioned[:_MAX_LISTED])
        more = len(uncaptioned) - _MAX_LISTED
        raise DataError(
            f"{len(uncaptioned)} image(s) in {folder} have no caption:\n  {listed}"
            + (f"\n  ... and {more} more" if more > 0 else "")
            + f"\nAdd a same-stem {CAPTION_SUFFIX} file next to each (e.g. cat.png -> cat.txt)."
        )
    return [ImageItem(path, _read_caption(path.with_suffix(CAPTION_SUFFIX))) for path in images]


def load_image(path: Path, resolution: int) -> torch.Tensor:
    """The image at `path` as a float32 tensor (3, resolution, resolution) in [-1, 1].

    The shorter side is scaled to `resolution` (Lanczos) and the centre square kept.
    """
    try:
        with Image.open(path) as image:
            image.load()  # decode now, so a truncated file fails here rather than later
            image = ImageOps.exif_transpose(image)  # phone photos store rotation in EXIF
            rgb = _to_rgb(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise DataError(
            f"cannot read image {path} ({error}): replace or delete the file."
        ) from error

    # Crop the centre square in source pixels and resize it in one step: the same result as
    # resizing the shorter side then cropping, with a single resampling and no rounding of
    # the intermediate size.
    width, height = rgb.size
    side = min(width, height)
    left, top = (width - side) / 2, (height - side) / 2
    box = (left, top, left + side, top + side)
    square = rgb.resize((resolution, resolution), Image.Resampling.LANCZOS, box=box)

    pixels = torch.from_numpy(np.array(square, dtype=np.uint8))  # (H, W, 3), a writable copy
    return (pixels.permute(2, 0, 1).float() / 127.5 - 1.0).contiguous()


def file_fingerprint(path: Path) -> str:
    """The sha256 hex digest of the file's bytes.

    The one place that decides when a source file counts as changed (cache keys use it), so a
    faster scheme (e.g. a stat index) can replace hashing here without touching the callers.
    """
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


def _read_caption(path: Path) -> str:
    try:
        # utf-8-sig: drops the byte-order mark some Windows editors write.
        return path.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError as error:
        raise DataError(f"caption {path} is not UTF-8 text ({error}): save it as UTF-8.")
    except OSError as error:
        raise DataError(f"cannot read caption {path} ({error}): check its permissions.")


def _is_hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)
