"""Benchmark of dataset start-up and cache filling on this machine.

    .venv/bin/python scripts/bench_cache.py                       # 100k files, as in the issue
    .venv/bin/python scripts/bench_cache.py --files 10000 --dir /tmp/b

1. Writes a synthetic dataset of N small images with captions (once; reused on later runs).
2. First start: scans, hashes and probes every file, decodes them in worker processes and fills
   the cache with a stub encoder (pooled pixels: measures dpipe's own pipeline, not a VAE).
3. Second start: the same dataset again. It must read no file and encode nothing; its wall
   time is the start-up cost of a cached 100k-file dataset.
4. One file edited: only that file is read and re-encoded.
5. Cache throughput with real encoders: the tiny FLUX.1 (VAE + CLIP + T5) on CPU, items/s
   (one item = one image latent + its caption's text embeddings).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars would flood the figures


class StubSpec:
    """The ModelSpec surface the cache uses, with a trivial encoder."""

    family = "stub"
    pixel_multiple = 8

    def __init__(self):
        self.encoded = 0

    def encoder_fingerprint(self, kind):
        return {"family": "stub", "kind": kind}

    def load_encoders(self, device, dtype):
        return None

    def encode_images(self, encoders, pixels):
        self.encoded += len(pixels)
        return torch.nn.functional.avg_pool2d(pixels, 4)

    def encode_prompts(self, encoders, prompts):
        self.encoded += len(prompts)
        return {"t5": torch.zeros(len(prompts), 4, 8), "pooled": torch.zeros(len(prompts), 8)}


def make_dataset(folder: Path, n: int, size: int) -> None:
    marker = folder / f".complete-{n}-{size}"
    if marker.exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for i in range(n):
        sub = folder / f"{i // 1000:03d}"  # 1000 files per folder, as large datasets are kept
        if i % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (size, size, 3), np.uint8)).save(sub / f"{i:06d}.png")
        (sub / f"{i:06d}.txt").write_text(f"image number {i}, a test pattern")
    marker.touch()
    print(f"wrote {n} images + captions in {time.perf_counter() - start:.1f} s")


def config(folder: Path, cache: Path, resolution: int, workers: int | None):
    from dpipe.config.schema import DatasetConfig

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DatasetConfig), {
        "path": str(folder), "cache_dir": str(cache), "resolutions": [resolution],
        "num_aspect_buckets": 1, "cache_workers": workers}))


def timed_prepare(spec, cfg):
    from dpipe.data.prepare import Layout, prepare

    start, cpu = time.perf_counter(), time.process_time()
    dataset = prepare(spec, cfg, torch.device("cpu"), torch.float32, Layout())
    dataset.cpu_seconds = time.process_time() - cpu  # this process only (not decode workers)
    return time.perf_counter() - start, dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=16, help="image side in pixels")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "dpipe-bench")
    parser.add_argument("--workers", type=int, default=None, help="decode processes (auto)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="start from the cache a previous run left (re-measures the warm "
                             "start without the long first fill)")
    parser.add_argument("--encoder-items", type=int, default=256,
                        help="images for the tiny-FLUX throughput part (0 skips it)")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    results: dict[str, float] = {"files": args.files, "cpus": os.cpu_count()}

    data, cache = args.dir / f"data-{args.files}", args.dir / "cache"
    make_dataset(data, args.files, args.size)
    if not args.keep_cache:
        shutil.rmtree(cache, ignore_errors=True)
    cfg = config(data, cache, args.size, args.workers)

    spec = StubSpec()
    seconds, first = timed_prepare(spec, cfg)
    items = first.stats["latents"] + first.stats["texts"]
    results |= {"first_start_s": round(seconds, 2), "first_entries": items,
                "first_items_per_s": round(args.files / seconds, 1)}
    print(f"first start (scan, hash, decode, stub-encode, write {items} entries): "
          f"{seconds:.1f} s = {args.files / seconds:.0f} files/s"
          + (" (cache kept from an earlier run)" if args.keep_cache else ""))

    spec = StubSpec()
    seconds, second = timed_prepare(spec, cfg)
    assert spec.encoded == 0 and second.stats["files_read"] == 0, second.stats
    results |= {"second_start_s": round(seconds, 2),
                "second_start_cpu_s": round(second.cpu_seconds, 2)}
    print(f"second start ({args.files} files, nothing read or decoded): {seconds:.2f} s "
          f"({second.cpu_seconds:.2f} s of CPU)")

    edited = next(data.glob("000/000007.png"))
    colour = tuple(time.time_ns().to_bytes(8, "little")[:3])  # new content on every run
    Image.new("RGB", (args.size, args.size), colour).save(edited)
    spec = StubSpec()
    seconds, third = timed_prepare(spec, cfg)
    assert third.stats["files_read"] == 1 and spec.encoded == 1, third.stats
    results |= {"one_edited_start_s": round(seconds, 2)}
    print(f"start after editing one file (1 read, 1 re-encoded): {seconds:.2f} s")

    if args.encoder_items:
        results |= encoder_throughput(args.dir, args.encoder_items, args.workers)
    print(json.dumps(results))


def encoder_throughput(root: Path, n: int, workers: int | None) -> dict:
    """Items/s filling the cache with the tiny FLUX.1's real VAE and text encoders (CPU)."""
    from dpipe.config.schema import ModelConfig
    from dpipe.models.registry import build_spec

    model = Path(os.environ.get("DPIPE_CACHE", root)) / "models" / "tiny-flux"
    spec = build_spec(OmegaConf.to_object(OmegaConf.merge(
        OmegaConf.structured(ModelConfig),
        {"family": "flux", "path": str(model), "tiny": True, "max_text_tokens": 32})))
    spec.ensure_available()
    data, cache = root / f"flux-data-{n}", root / "flux-cache"
    make_dataset(data, n, 96)
    shutil.rmtree(cache, ignore_errors=True)
    seconds, dataset = timed_prepare(spec, config(data, cache, 64, workers))
    assert dataset.stats["latents"] == n
    print(f"tiny FLUX.1 encoders: {n} images (96 px -> 64x64) + {n} captions in {seconds:.1f} s "
          f"= {n / seconds:.1f} items/s (model load included)")
    return {"flux_items": n, "flux_s": round(seconds, 2), "flux_items_per_s": round(n / seconds, 1)}


if __name__ == "__main__":
    main()
