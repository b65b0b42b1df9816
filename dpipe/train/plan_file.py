"""`<run>/plan.json`: what the run was predicted to use, and what it used.

Before the workers start, the launcher of a GPU run writes the plan's GPU peak per stage, each
process's host peak while loading and the cache disk (`dpipe-train`, from the plan it checks the
run against: the figures `dpipe-train --plan` prints for that layout). Where it wrote none (a
run without GPUs, or ranks someone else started), each rank's host memory is estimated at the
start of training from its loaded layers (`loading_bytes` of its stage's layers and a
process's allowance) and rank 0 writes them all.
At the end every process's host peak (its resident memory's high-water mark), each stage's GPU
peak (`torch.cuda.max_memory_allocated`, where CUDA exists) and the cache folder's bytes are
added, and rank 0 logs how far each was from its prediction.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch
import torch.distributed as dist

from dpipe.io import atomic_write_text, show_bytes
from dpipe.pipeline.memory import GiB, PROCESS_HOST, loading_bytes

PLAN_FILE = "plan.json"


def read(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write(run_dir: Path, record: dict) -> None:
    atomic_write_text(run_dir / PLAN_FILE, json.dumps(record, indent=2) + "\n")


def write_launch_prediction(run_dir: Path, gpu_peaks: list[int] | None,
                            cache_disk: int | None, host_peaks: list[int] | None = None) -> None:
    """The launcher's part, before any worker starts (a new launch's record replaces the last);
    `host_peaks`: each process's while loading, in rank order."""
    predicted = {"gpu_peak_per_stage": gpu_peaks, "cache_disk": cache_disk}
    if host_peaks is not None:
        predicted["host_peak_per_process"] = host_peaks
    write(run_dir, {"predicted": predicted})


def bytes_as_read(layer: torch.nn.Module) -> int:
    """A loaded layer's weights and buffers as its stage read them: each tensor in its dtype, a
    quantized base's weights (fp8, int8) in the dtype they were read in before quantizing."""
    total = 0
    for module in layer.modules():
        # A quantized Linear (QuantizedLinear, NF4Linear) keeps the dtype it was read in.
        read_as = getattr(module, "compute_dtype", None) if hasattr(module, "in_features") \
            else None
        for name, t in [*module.named_parameters(recurse=False),
                        *module.named_buffers(recurse=False)]:
            if read_as is not None and name == "weight":
                total += module.in_features * module.out_features * read_as.itemsize
            else:
                total += t.numel() * t.element_size()
    return total


def record_start(run_dir: Path, local_layers: list, all_layers: list, stage_only: bool) -> None:
    """Each rank's predicted host peak (a collective): its stage read alone (`stage_only`), or
    the whole denoiser in fp32, and a process's allowance; rank 0 adds them to plan.json
    where the launcher's plan wrote none (that one is the plan's own figure)."""
    if stage_only:
        need = loading_bytes([bytes_as_read(layer) for layer in local_layers])
    else:
        need = 4 * sum(q.numel() for layer in all_layers for q in layer.parameters())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, need + PROCESS_HOST)
    if dist.get_rank() == 0:
        record = read(run_dir)
        predicted = record.get("predicted", {})
        predicted.setdefault("host_peak_per_process", everyone)
        write(run_dir, {"predicted": predicted})


def record_end(run_dir: Path, stage: int, cache_dir: Path) -> str | None:
    """Adds what the run used to plan.json (a collective); rank 0 gets the line that compares it
    with the prediction."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (stage, host, gpu))
    if dist.get_rank() != 0:
        return None
    stages = max(s for s, _, _ in everyone) + 1
    gpu_peaks = None if gpu is None else [
        max(g for s, _, g in everyone if s == i) for i in range(stages)]
    disk = sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file()) \
        if cache_dir.is_dir() else 0
    record = read(run_dir)
    record["measured"] = {"gpu_peak_per_stage": gpu_peaks,
                          "host_peak_per_process": [h for _, h, _ in everyone],
                          "cache_disk": disk}
    write(run_dir, record)
    return comparison(record)


def comparison(record: dict) -> str:
    """plan.json's measured figures against the predicted ones, in one line."""
    predicted, measured = record.get("predicted", {}), record["measured"]

    def versus(key: str, what: str) -> str:
        got, expected = measured.get(key), predicted.get(key)
        if got is None:
            return f"{what}: not measured (no CUDA)"
        if expected is None:
            return f"{what} {_figures(got)}, predicted: none made"
        off = " / ".join(f"{100 * (g - e) / e:+.0f}%" if e else "-"
                         for g, e in zip(_list(got), _list(expected)))
        return f"{what} {_figures(got)}, predicted {_figures(expected)} ({off})"

    return "plan vs run: " + "; ".join([
        versus("host_peak_per_process", "host peak per process"),
        versus("gpu_peak_per_stage", "GPU peak per stage"),
        versus("cache_disk", "cache disk")]) + f" ({PLAN_FILE})"


def _list(x) -> list:
    return x if isinstance(x, list) else [x]


def _figures(x) -> str:
    if isinstance(x, list):
        return " / ".join(f"{v / GiB:.2f}" for v in x) + " GiB"
    return show_bytes(x)
