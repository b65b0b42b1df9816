"""What reading one training step's cache entries costs, and how much of it is the checksum.

    .venv/bin/python scripts/bench_cache_reads.py                  # FLUX.1-dev, 1024^2, 8 a step
    .venv/bin/python scripts/bench_cache_reads.py --samples 4 --dir /scratch/b

Writes the entries of N samples as dpipe caches a FLUX.1-dev image at 1024x1024 (float32 latents
(16, 128, 128); T5 (512, 4096) and CLIP pooled (768,) text embeddings), then reads them back as a
step does (`TensorStore.get`, one process, page cache warm), and times the CRC-32 of the same
tensors on its own. On GPU the loader's worker processes do this ahead of the step; on CPU
(`train.loader_workers=0`) it is part of the step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dpipe.data.cache_store import TensorStore, cache_key, checksum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8, help="samples per step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the entries")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a loader worker's share
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = TensorStore(Path(tmp))
        keys = []
        for i in range(args.samples):
            latent, text = cache_key(sample=i, kind="latents"), cache_key(sample=i, kind="text")
            store.put(latent, {"latents": torch.randn(16, 128, 128)})
            store.put(text, {"t5": torch.randn(512, 4096), "pooled": torch.randn(768)})
            keys += [latent, text]
        size = sum(store.path_for(k).stat().st_size for k in keys)
        reads, crcs = [], []
        for _ in range(args.repeats + 1):  # the first round warms up
            start = time.perf_counter()
            entries = [store.get(k) for k in keys]
            reads.append(time.perf_counter() - start)
            start = time.perf_counter()
            for tensors in entries:
                checksum(tensors)
            crcs.append(time.perf_counter() - start)
        read, crc = statistics.median(reads[1:]), statistics.median(crcs[1:])
        print(f"{args.samples} samples a step, {size / 2**20:.1f} MiB of entries: read and verify "
              f"{read * 1e3:.1f} ms a step, of which the checksum {crc * 1e3:.1f} ms "
              f"({size / 2**30 / crc:.2f} GiB/s); {crc / args.samples * 1e3:.2f} ms a sample")


if __name__ == "__main__":
    main()
