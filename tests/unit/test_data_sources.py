"""Synthetic shapes, folder scanning, image decoding and file fingerprints."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dpipe.data.discover import directories, discover
from dpipe.data.sources import file_fingerprint, image_extensions
from dpipe.images import load_image
from dpipe.data.synthetic import COLOURS, MANIFEST_NAME, SHAPES, generate_shapes
from dpipe.errors import DataError


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# --- synthetic ---------------------------------------------------------------------------------


def test_synthetic_is_byte_identical_for_the_same_args(tmp_path):
    a = generate_shapes(tmp_path / "a", num_images=6, resolution=32, seed=3)
    b = generate_shapes(tmp_path / "b", num_images=6, resolution=32, seed=3)
    assert _files(a) == _files(b)
    assert sorted(p.name for p in a.glob("*.png")) == [f"{i:05d}.png" for i in range(6)]
    assert _files(a) != _files(generate_shapes(tmp_path / "c", 6, 32, seed=4))


def test_synthetic_captions_describe_the_image(tmp_path):
    folder = generate_shapes(tmp_path / "shapes", num_images=8, resolution=64)
    for caption_file in folder.glob("*.txt"):
        caption = caption_file.read_text().strip()
        words = caption.split()  # "a <colour> <shape> on a(n) <colour> background"
        assert words[0] in ("a", "an") and words[3] == "on" and words[-1] == "background"
        colour, shape, background = words[1], words[2], words[5]
        assert colour in COLOURS and background in COLOURS and colour != background
        assert shape in SHAPES
        pixels = np.asarray(Image.open(caption_file.with_suffix(".png")))
        assert tuple(pixels[0, 0]) == COLOURS[background] or tuple(pixels[-1, -1]) == COLOURS[
            background
        ]
        assert (pixels == COLOURS[colour]).all(axis=-1).sum() > 0  # the shape is drawn


def test_synthetic_is_idempotent(tmp_path):
    folder = generate_shapes(tmp_path / "shapes", num_images=3, resolution=32)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert generate_shapes(folder, num_images=3, resolution=32) == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["shapes"]  # no temp folders left


def test_synthetic_concurrent_callers_agree(tmp_path):
    folder = tmp_path / "shapes"
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: generate_shapes(folder, 4, 32, seed=1), range(8)))
    assert results == [folder] * 8
    assert _files(folder) == _files(generate_shapes(tmp_path / "ref", 4, 32, seed=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref", "shapes"]


def test_synthetic_param_mismatch_names_the_folder(tmp_path):
    folder = generate_shapes(tmp_path / "shapes", num_images=3, resolution=32)
    with pytest.raises(DataError, match="delete") as info:
        generate_shapes(folder, num_images=4, resolution=32)
    assert str(folder) in str(info.value) and "num_images=3" in str(info.value)


def test_synthetic_refuses_a_foreign_folder_but_fills_an_empty_one(tmp_path):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.png").write_bytes(b"")
    with pytest.raises(DataError, match=str(foreign)):
        generate_shapes(foreign, 2, 32)
    empty = tmp_path / "empty"
    empty.mkdir()
    generate_shapes(empty, 2, 32)
    assert json.loads((empty / MANIFEST_NAME).read_text())["num_images"] == 2


# --- scanning ----------------------------------------------------------------------------------


def _write_image(path: Path, mode: str = "RGB", size=(8, 8), colour=0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


def _discover(folder, **settings):
    from tests.unit.test_data_support import dataset_config

    cfg = dataset_config(path=str(folder), **settings)
    return discover(directories(cfg), Path(cfg.cache_dir), cfg.strict)


def test_scan_reads_captions_sorted_and_recursive(tmp_path):
    _write_image(tmp_path / "b.png")
    (tmp_path / "b.txt").write_text("  second  \n")
    _write_image(tmp_path / "a" / "z.JPG")
    (tmp_path / "a" / "z.txt").write_text("\ufefffirst")  # BOM from a Windows editor
    _write_image(tmp_path / ".ipynb_checkpoints" / "b.png")  # hidden: skipped
    (tmp_path / "notes.md").write_text("not an image")

    items = _discover(tmp_path).items
    assert [(Path(i.path), i.captions) for i in items] == [
        (tmp_path / "a" / "z.JPG", ["first"]),
        (tmp_path / "b.png", ["second"]),
    ]


def test_scan_accepts_what_pillow_opens():
    assert {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif"} <= image_extensions()
    assert ".txt" not in image_extensions() and ".pdf" not in image_extensions()
    assert ".mp4" not in image_extensions()


def test_scan_synthetic_folder(tmp_path):
    folder = generate_shapes(tmp_path / "shapes", num_images=3, resolution=32)
    items = _discover(folder).items
    assert [Path(item.path).name for item in items] == ["00000.png", "00001.png", "00002.png"]
    assert all(item.captions[0].startswith("a ") for item in items)


def test_scan_lists_images_without_captions(tmp_path):
    for i in range(12):
        _write_image(tmp_path / f"img{i:02d}.png")
    (tmp_path / "img00.txt").write_text("captioned")
    with pytest.raises(DataError, match="no caption") as info:
        _discover(tmp_path)
    message = str(info.value)
    assert "11 problem(s)" in message and str(tmp_path / "img01.png") in message
    assert str(tmp_path / "img10.png") in message and "img11.png" not in message
    assert "1 more" in message


def test_scan_empty_folder_says_which_extensions(tmp_path):
    (tmp_path / "readme.txt").write_text("no images here")
    with pytest.raises(DataError, match="no images or videos") as info:
        _discover(tmp_path)
    assert str(tmp_path) in str(info.value) and ".png" in str(info.value)


def test_scan_missing_folder_or_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        _discover(tmp_path / "nope")
    (tmp_path / "file.png").write_bytes(b"")
    with pytest.raises(DataError, match="is a file"):
        _discover(tmp_path / "file.png")


# --- loading -----------------------------------------------------------------------------------


def test_load_unreadable_image_names_the_file(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(DataError, match="bad.png"):
        load_image(bad, 16)


def test_load_truncated_image_names_the_file(tmp_path):
    path = tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataError, match="cut.png"):
        load_image(path, 16)


@pytest.mark.parametrize(
    "mode, colour, expected_rgb",
    [
        ("RGB", (255, 0, 0), (255, 0, 0)),
        ("RGBA", (0, 0, 255, 0), (255, 255, 255)),  # fully transparent -> white
        ("RGBA", (0, 0, 255, 255), (0, 0, 255)),
        ("LA", (0, 128), (127, 127, 127)),  # half-transparent black over white
        ("L", 0, (0, 0, 0)),
        ("1", 1, (255, 255, 255)),
        ("I;16", 128 * 257, (128, 128, 128)),  # 16-bit grey: scaled, not clipped to 255
        ("CMYK", (0, 255, 255, 0), (255, 0, 0)),
    ],
)
def test_load_converts_modes_to_rgb(tmp_path, mode, colour, expected_rgb):
    suffix = ".tif" if mode == "CMYK" else ".png"  # PNG has no CMYK
    path = _write_image(tmp_path / f"x{suffix}", mode, (20, 12), colour)
    tensor = load_image(path, 8)
    assert tensor.shape == (3, 8, 8) and tensor.dtype == torch.float32
    assert tensor.is_contiguous()
    expected = torch.tensor(expected_rgb, dtype=torch.float32) / 127.5 - 1
    assert torch.allclose(tensor, expected[:, None, None].expand(3, 8, 8), atol=1 / 127.5)


def test_load_palette_with_and_without_transparency(tmp_path):
    palette_image = Image.new("P", (10, 10), 1)
    palette_image.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)  # index 1 is green
    opaque = tmp_path / "opaque.png"
    palette_image.save(opaque)
    transparent = tmp_path / "transparent.png"
    palette_image.save(transparent, transparency=1)

    green = torch.tensor([-1.0, 1.0, -1.0])[:, None, None]
    assert torch.equal(load_image(opaque, 4), green.expand(3, 4, 4))
    assert torch.equal(load_image(transparent, 4), torch.ones(3, 4, 4))  # white


def test_load_values_span_minus_one_to_one(tmp_path):
    pixels = np.zeros((16, 16, 3), np.uint8)
    pixels[:, 8:] = 255
    path = tmp_path / "half.png"
    Image.fromarray(pixels).save(path)
    tensor = load_image(path, 16)  # same size: only the resampling, which keeps flat areas
    assert tensor.min() == -1.0 and tensor.max() == 1.0
    assert torch.equal(tensor[:, :, 0], -torch.ones(3, 16)) and torch.equal(
        tensor[:, :, -1], torch.ones(3, 16)
    )


@pytest.mark.parametrize("size", [(120, 40), (40, 120)])  # wide and tall
def test_load_crops_the_centre(tmp_path, size):
    # Three equal bands along the long side: red, green, blue. The centre crop is the green band.
    long_axis = 1 if size[0] > size[1] else 0
    pixels = np.zeros((size[1], size[0], 3), np.uint8)
    bands = np.array_split(np.arange(max(size)), 3)
    for channel, band in enumerate(bands):
        index = [slice(None), slice(None)]
        index[long_axis] = band
        pixels[tuple(index) + (channel,)] = 255
    path = tmp_path / "bands.png"
    Image.fromarray(pixels).save(path)

    tensor = load_image(path, 20)
    assert tensor.shape == (3, 20, 20)
    inner = tensor[:, 3:-3, 3:-3]  # away from edges, where Lanczos sees the neighbour bands
    assert torch.allclose(inner[1], torch.ones_like(inner[1]), atol=0.02)
    assert torch.allclose(inner[[0, 2]], -torch.ones_like(inner[[0, 2]]), atol=0.02)
    # Centred: the red and blue bands bleed equally into their edges.
    red_edge = tensor[0].select(long_axis, 0).mean()
    blue_edge = tensor[2].select(long_axis, -1).mean()
    assert torch.isclose(red_edge, blue_edge, atol=1e-5)


def test_load_upscales_small_images(tmp_path):
    path = _write_image(tmp_path / "small.png", "RGB", (4, 6), (0, 0, 255))
    tensor = load_image(path, 32)
    assert tensor.shape == (3, 32, 32)
    assert torch.allclose(tensor[2], torch.ones(32, 32), atol=1e-6)


# --- fingerprint -------------------------------------------------------------------------------


def test_file_fingerprint_is_sha256_of_bytes(tmp_path):
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 10_000  # several read chunks
    path.write_bytes(data)
    assert file_fingerprint(path) == hashlib.sha256(data).hexdigest()
    path.write_bytes(data[:-1] + b"x")
    assert file_fingerprint(path) != hashlib.sha256(data).hexdigest()
    with pytest.raises(DataError, match="missing.bin"):
        file_fingerprint(tmp_path / "missing.bin")
