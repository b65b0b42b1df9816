"""The machine a plan is for: its GPUs' free memory, the host's memory, the cache disk's space.

Either the one this process sees (`visible`), or an emulated one (`parse("2x24", host_gib=64)`)
for `dpipe-train --plan --machine 2x24,host=64` and the planner's tests.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dpipe.errors import ConfigError

GiB = 1 << 30
# A GPU of 32 GiB or less is taken for a consumer card (RTX 3090/4090/5090 class), a larger one
# for a data-centre card (A100/H100/H200): the model FLOP/s a training step reaches on each,
# bf16, what the step times are estimated at (an H200 measured ~450, docs/performance.md).
CONSUMER_FLOPS, DATACENTRE_FLOPS = 100e12, 400e12
# Pinned host -> device copies over PCIe 4.0 x16, as the block swap streams them (the memory plan
# measures its own on the first step; this estimates the plan before any GPU is touched).
HOST_TO_DEVICE = 20e9
# A card of G GiB leaves about G - 1 GiB for a run's allocations: the CUDA context and what the
# allocator cannot use (a 24 GB card runs FLUX.1-dev's preset at a 23 GiB budget,
# docs/performance.md).
CONTEXT_GIB = 1.0


def size(n: int) -> str:
    """Bytes in GiB, or MiB below one GiB (a small dataset's cache)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class Machine:
    gpus: int
    gpu_gib: float  # free memory per GPU
    host_gib: float  # host memory the run may use
    disk_gib: float | None = None  # free space on the cache disk; None: not checked

    @property
    def name(self) -> str:
        return (f"{self.gpus} GPU{'s' if self.gpus != 1 else ''} with {self.gpu_gib:g} GiB free, "
                f"{self.host_gib:g} GiB host")

    @property
    def flops(self) -> float:
        return CONSUMER_FLOPS if self.gpu_gib <= 32 else DATACENTRE_FLOPS

    def with_gpus(self, gpus: int) -> "Machine":
        return Machine(gpus, self.gpu_gib, self.host_gib, self.disk_gib)


def parse(text: str, key: str = "--machine") -> Machine:
    """`NxG[,host=H][,disk=D]` (GiB): N GPUs of G GiB (G - 1 free for the run), H GiB of host
    memory (default 64), D GiB free on the cache disk (default: not checked). `key`: where the
    text came from (`--machine`, or a config's `pipeline.machine`), for the error."""
    head, *rest = [part.strip() for part in text.split(",")]
    try:
        count, size = head.lower().split("x")
        options = dict(part.split("=", 1) for part in rest)
        unknown = set(options) - {"host", "disk"}
        if unknown:
            raise ValueError
        disk = options.get("disk")
        return Machine(int(count), float(size) - CONTEXT_GIB, float(options.get("host", 64)),
                       None if disk is None else float(disk))
    except ValueError:
        sep = " " if key.startswith("--") else "="
        raise ConfigError(f"{key}{sep}{text}: give GPUs x GiB per GPU, and optionally the host's "
                          "memory and the cache disk's free space in GiB, e.g. "
                          f"{key}{sep}2x24,host=64,disk=500") from None


def host_available_gib() -> float:
    """MemAvailable with the swap space free (what the kernel can still give before it kills)."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return (info["MemAvailable"] + info.get("SwapFree", 0)) / GiB


def disk_free_gib(folder: Path) -> float:
    existing = next(p for p in (folder, *folder.parents) if os.path.lexists(p))
    return shutil.disk_usage(existing).free / GiB


def visible(cache_dir: Path, free: bool = True) -> Machine:
    """The GPUs this process sees (the least free memory of them; `free=False`: their total
    less the CUDA context, the same on every rank of a torchrun/SLURM launch), the host, the
    cache disk."""
    import torch

    gpus = torch.cuda.device_count()
    if free:
        per_gpu = min((torch.cuda.mem_get_info(i)[0] for i in range(gpus)), default=0) / GiB
    else:
        per_gpu = min((torch.cuda.get_device_properties(i).total_memory for i in range(gpus)),
                      default=0) / GiB - CONTEXT_GIB
    return Machine(gpus, round(per_gpu, 1), round(host_available_gib(), 1),
                   round(disk_free_gib(cache_dir), 1))
