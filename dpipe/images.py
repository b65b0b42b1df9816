"""Image files as training data and samplers' control images read them: decoded upright as 8-bit
RGB, fitted to a size by scaling to cover and keeping the centre, as tensors in [-1, 1]. Every
failure to read names the file (DataError)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from dpipe.errors import DataError

# EXIF orientations that turn the picture by 90 degrees (the stored width is the shown height).
_TRANSPOSED = {5, 6, 7, 8}


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
