"""The plan of one composed run: the model's size it is computed at, the dataset's files, the
keys the user set (the planner's constraints)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dpipe.config.schema import BaseCompute, RunConfig
from dpipe.errors import ConfigError
from dpipe.plan.choose import PLANNED_KEYS, Plan, choose
from dpipe.plan.footprint import ModelFootprint, measure
from dpipe.plan.machine import Machine

MEDIA = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".mp4", ".mov",
         ".webm", ".mkv", ".avi", ".m4v"}


@dataclass(frozen=True)
class RunPlan:
    plan: Plan
    footprint: ModelFootprint
    size: str  # the benchmark size the model was built at
    resolution: int
    frames: int
    files: int | None


def model_size(spec, run: RunConfig) -> str:
    """The benchmark size (`spec.bench_configs`) that is the model at `model.path`: the one whose
    config agrees with the folder's on the most keys; the first real size without a folder."""
    sizes = [s for s in spec.bench_sizes() if s != "tiny"]
    if run.model.tiny:
        return "tiny"
    if not sizes:
        raise ConfigError(f"model.family={spec.family}: dpipe has no real-size config of it to "
                          "plan from (its spec's bench_configs); plan a run of a family that "
                          "has one (docs/performance.md, 'Per-layer times')")
    # The class's own folder name: a family that reads it from the model's folder (Wan 2.2's two
    # experts) reads a folder that may not be there.
    sub = getattr(type(spec), "denoiser_folder", "transformer")
    folder = Path(run.model.path).expanduser() / (sub if isinstance(sub, str) else "transformer")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return sizes[0]
    agree = lambda s: sum(config.get(k) == v for k, v in spec.bench_configs[s].items()  # noqa
                          if not k.startswith("_"))
    return max(sizes, key=agree)


def dataset_files(run: RunConfig) -> int | None:
    """Image and video files under the dataset's folders; None where there are none to count."""
    folders = [run.dataset.path] if run.dataset.path else []
    folders += [d.path for d in run.dataset.directories]
    paths = [Path(f).expanduser() for f in folders if f]
    if not paths or not all(p.is_dir() for p in paths):
        return None
    return sum(1 for p in paths for f in p.rglob("*") if f.suffix.lower() in MEDIA)


def user_keys(overrides: list[str], preset_keys: set[str] = frozenset()) -> set[str]:
    """The planner's keys the command line (or an experiment preset) set; `pipeline=auto` and
    `pipeline=<name>` leave them to the planner and set them, respectively."""
    keys = {o.split("=", 1)[0].lstrip("~+") for o in overrides}
    out = {k for k in PLANNED_KEYS if k in keys or k in preset_keys}
    choice = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "pipeline"),
                  None)
    if choice is not None and choice != "auto":
        out |= {"pipeline.stages", "pipeline.activation_checkpointing", "pipeline.blocks_to_swap"}
    return out


def plan_run(spec, run: RunConfig, machine: Machine, fixed: set[str],
             encoders: int | None = None, world: int | None = None) -> RunPlan:
    size = model_size(spec, run)
    resolution = run.dataset.resolution
    frames = max(run.dataset.frame_buckets or [1])
    footprint = measure(spec, run, size, resolution, frames)
    files = dataset_files(run)
    return RunPlan(choose(footprint, run, machine, fixed, files, encoders, world), footprint, size,
                   resolution, frames, files)


def run_layout(spec, run: RunConfig, machine: Machine, data_parallel: int) -> RunPlan:
    """The plan of the run as configured (its stages, replicas, base storage, recompute and
    swap), on `machine`."""
    from dpipe.plan.choose import layout

    size = model_size(spec, run)
    resolution, frames = run.dataset.resolution, max(run.dataset.frame_buckets or [1])
    footprint = measure(spec, run, size, resolution, frames)
    files = dataset_files(run)
    eight_bit = run.model.base_dtype.quantized or run.model.base_compute != BaseCompute.auto
    return RunPlan(layout(footprint, run, machine, run.pipeline.stages, data_parallel,
                          eight_bit, files), footprint, size, resolution, frames, files)
