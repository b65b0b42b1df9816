"""Benchmark of encoder fingerprints (cache keys' model identity) on this machine.

    .venv/bin/python scripts/bench_fingerprint.py                  # a 20 GB model folder
    .venv/bin/python scripts/bench_fingerprint.py --gb 2 --dir /scratch/b

1. Writes a model component folder of random weights (shards of random bytes, a config and a
   shard index, as a text encoder's), flushed to disk and dropped from the page cache, so the
   first fingerprint reads every byte from the disk.
2. Cold: no digest index yet (a fresh DPIPE_CACHE): every byte is read and hashed.
3. Warm: the next start, from the index: only a stat of each file.
4. One shard edited (one byte in its middle): only that shard is read again.
The folder and the index are deleted at the end (unless --keep).
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

CHUNK = 64 << 20


def write_random(path: Path, size: int, rng: np.random.Generator) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(CHUNK, left)
            f.write(rng.bytes(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())
        # Written pages stay cached: without this the "cold" read would come from memory.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def make_folder(folder: Path, total: int, shards: int) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["T5EncoderModel"]}))
    rng = np.random.default_rng(0)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for i, name in enumerate(names):
        write_random(folder / name, total // shards + (i < total % shards), rng)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"layer.{i}": n for i, n in enumerate(names)}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=20.0, help="folder size, GB (1e9 bytes)")
    parser.add_argument("--shards", type=int, default=4, help="weights files (5 GB each at 20)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the folder and the index")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dpipe-bench-fp-", dir=args.dir))
    os.environ["DPIPE_CACHE"] = str(work / "cache")  # a fresh index: the first call is cold
    from dpipe.models.fingerprint import folder_fingerprint

    folder = work / "text_encoder"
    total = int(args.gb * 1e9)
    try:
        free = shutil.disk_usage(work).free
        if free < total * 1.05:
            raise SystemExit(f"error: {work} has {free / 1e9:.1f} GB free, the folder needs "
                             f"{total / 1e9:.1f} GB: pass a smaller --gb or another --dir.")
        t = time.perf_counter()
        make_folder(folder, total, args.shards)
        print(f"wrote {total / 1e9:.1f} GB in {args.shards} shards to {folder} "
              f"({time.perf_counter() - t:.0f} s); cores: {os.cpu_count()}")

        t = time.perf_counter()
        cold = folder_fingerprint(folder)
        cold_s = time.perf_counter() - t
        print(f"cold (no index, nothing cached): {cold_s:7.2f} s  "
              f"({total / 1e9 / cold_s:.2f} GB/s)")

        t = time.perf_counter()
        warm = folder_fingerprint(folder)
        warm_s = time.perf_counter() - t
        assert warm == cold
        print(f"warm (index, stat only):         {warm_s * 1000:7.2f} ms")

        shard = sorted(folder.glob("*.safetensors"))[0]
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        edited = folder_fingerprint(folder)
        edited_s = time.perf_counter() - t
        assert edited != cold
        print(f"one shard edited (1 byte):       {edited_s:7.2f} s  "
              f"(re-reads {shard.stat().st_size / 1e9:.1f} GB)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
