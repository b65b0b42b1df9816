"""A reproducible toy dataset: coloured shapes on coloured backgrounds, each with a caption.

Demos and tests train on it so that a run needs no downloaded data. The same arguments always give
byte-identical files (for one Pillow version), and several processes (e.g. every rank of a run) may
call `generate_shapes` on the same folder at once: each draws into its own hidden sibling folder
and renames it into place, so the folder is either absent or complete, never half-written.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import uuid
from pathlib import Path

from PIL import Image, ImageDraw

from dpipe.errors import DataError

MANIFEST_NAME = "dpipe_synthetic.json"
# Bump when the drawing or captions change, so that a folder drawn by an older version is reported
# (params differ) instead of being silently reused as if it were the new data.
GENERATOR_VERSION = 1

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "orange": (245, 140, 30),
    "yellow": (240, 220, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 220),
    "purple": (140, 60, 190),
    "pink": (245, 130, 190),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "grey": (128, 128, 128),
}
SHAPES = ("circle", "square", "triangle", "diamond", "hexagon", "star")


def generate_shapes(folder: Path, num_images: int, resolution: int, seed: int = 0) -> Path:
    """Fill `folder` with `num_images` shape images (`00000.png`, ...) and their `.txt` captions.

    Does nothing if `folder` already holds images made with the same arguments; raises `DataError`
    if it holds anything else. Returns `folder`.
    """
    folder = Path(folder)
    _check_params(num_images, resolution)
    manifest = {
        "generator": "dpipe.data.synthetic.generate_shapes",
        "version": GENERATOR_VERSION,
        "num_images": num_images,
        "resolution": resolution,
        "seed": seed,
    }
    if _already_generated(folder, manifest):
        return folder

    folder.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would survive the rename and hide the data from other
    # users of a shared cluster filesystem.
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _draw_all(tmp, num_images, resolution, seed)
        # The manifest is written last: a folder with a manifest is complete.
        (tmp / MANIFEST_NAME).write_bytes(_manifest_bytes(manifest))
        try:
            os.rename(tmp, folder)  # atomic; fails if another caller's folder got there first
            return folder
        except OSError:
            # Another caller won the race (fine if it made the same data), or something else is
            # in the way, which `_already_generated` reports.
            if _already_generated(folder, manifest):
                return folder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # already gone after a successful rename


def draw_shape(index: int, resolution: int, seed: int = 0) -> tuple[Image.Image, str]:
    """The image and caption number `index` of the dataset with this `seed`.

    Each image has its own random stream, so the first N images do not depend on how many are made.
    """
    rng = random.Random(f"dpipe-shapes:{seed}:{index}")
    background, colour = rng.sample(sorted(COLOURS), 2)
    shape = rng.choice(SHAPES)
    radius = rng.uniform(0.12, 0.3) * resolution
    cx = rng.uniform(radius, resolution - radius)
    cy = rng.uniform(radius, resolution - radius)

    image = Image.new("RGB", (resolution, resolution), COLOURS[background])
    draw = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=fill)
    else:
        draw.polygon(_outline(shape, cx, cy, radius), fill=fill)
    caption = f"{_with_article(colour)} {shape} on {_with_article(background)} background"
    return image, caption


def _outline(shape: str, cx: float, cy: float, radius: float) -> list[tuple[float, float]]:
    """Corner points of a polygon shape, centred on (cx, cy)."""
    # (corners, angle of the first corner in degrees; -90 points up, since y grows downwards)
    corners, start = {
        "square": (4, -45.0),
        "triangle": (3, -90.0),
        "diamond": (4, -90.0),
        "hexagon": (6, 0.0),
        "star": (10, -90.0),
    }[shape]
    points = []
    for k in range(corners):
        # A star alternates outer points and inner notches.
        r = radius * (0.45 if shape == "star" and k % 2 else 1.0)
        angle = math.radians(start + 360.0 * k / corners)
        points.append((cx + r * math.cos(angle), cy + r * math.sin(angle)))
    return points


def _with_article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _draw_all(folder: Path, num_images: int, resolution: int, seed: int) -> None:
    # Wide enough that the names sort in numeric order however many images there are.
    width = max(5, len(str(num_images - 1)))
    for index in range(num_images):
        image, caption = draw_shape(index, resolution, seed)
        stem = f"{index:0{width}d}"
        image.save(folder / f"{stem}.png", format="PNG")
        (folder / f"{stem}.txt").write_bytes((caption + "\n").encode("utf-8"))


def _already_generated(folder: Path, manifest: dict) -> bool:
    """True if `folder` is complete with these params; False if absent or empty; else DataError."""
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise DataError(
            f"{folder} is a file, not a folder of synthetic images: "
            "delete it or set dataset.path to another folder."
        )
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        if not any(folder.iterdir()):
            return False  # an empty folder (e.g. made by the user) is filled by the rename
        raise DataError(
            f"{folder} already exists and was not made by the synthetic dataset generator "
            f"(it has no {MANIFEST_NAME}): delete it or set dataset.path to another folder."
        )
    if manifest_path.read_bytes() == _manifest_bytes(manifest):
        return True
    raise DataError(
        f"{folder} holds synthetic images made with other parameters "
        f"({_describe(manifest_path)}) than asked now ({_describe_params(manifest)}): "
        "delete the folder to regenerate it, or set dataset.path to another folder."
    )


def _manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, sort_keys=True, indent=2) + "\n").encode("utf-8")


def _describe(manifest_path: Path) -> str:
    try:
        return _describe_params(json.loads(manifest_path.read_text(encoding="utf-8")))
    except (ValueError, AttributeError):
        return f"unreadable {manifest_path.name}"


def _describe_params(manifest: dict) -> str:
    keys = ("num_images", "resolution", "seed", "version")
    return ", ".join(f"{k}={manifest.get(k)}" for k in keys)


def _check_params(num_images: int, resolution: int) -> None:
    if num_images < 1:
        raise DataError(f"dataset.num_images is {num_images}: set it to 1 or more.")
    if resolution < 16:
        raise DataError(f"dataset.resolution is {resolution}: set it to 16 or more.")
