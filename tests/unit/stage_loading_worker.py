"""A worker for tests/unit/test_stage_loading.py: reads one pipeline stage's weights of the
denoiser at `model.path` as a training rank does, and prints (as JSON) how far the process's
resident memory rose above what its libraries take, and the plan's bound for that stage; then
the same for each further group of overrides after a "--" (another model.path), each from where
the last left the process (run it with a fixed MALLOC_MMAP_THRESHOLD_, so that what a load frees
goes back to the system rather than serving the next one)."""

import gc
import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(args: list[str]) -> int:
    for library in ("accelerate", "diffusers", "peft"):  # what loading imports: before the baseline
        importlib.import_module(library)

    stage, groups = int(args[0]), [[]]
    for arg in args[1:]:
        if arg == "--":
            groups.append([])
        else:
            groups[-1].append(arg)
    for overrides in groups:
        print(json.dumps(measure(stage, overrides)), flush=True)
        gc.collect()
    return 0


def measure(stage: int, overrides: list[str]) -> dict[str, int]:
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec
    from dpipe.pipeline.partition import stage_bounds
    from dpipe.plan.choose import stage_loading_bytes
    from dpipe.plan.footprint import block_linears, layer_weights
    from dpipe.train.trainable import trainable_layers

    run = compose_run(overrides, world_size=run_stages(overrides))
    spec = build_spec(run.model)
    # The plan's bound: this stage's layers' weights as a worker reads them (a quantized
    # file's Linears as stored, where the LoRA keeps them so), from the model built on the meta
    # device (as dpipe.plan.footprint builds it), nothing read.
    skeleton = spec.denoiser_skeleton()
    with torch.device("meta"):
        meta = type(skeleton.model).from_config(skeleton.model.config)
        blocks = block_linears(meta)
        layers = trainable_layers(spec, run, meta)
    p = run.pipeline
    bounds = stage_bounds(spec.layer_costs(layers), p.stages, p.partition, p.split)
    weights = [SimpleNamespace(**layer_weights(layer, blocks))
               for layer in layers[bounds[stage]:bounds[stage + 1]]]
    bound = stage_loading_bytes(weights, run)
    del skeleton, meta, layers

    Path("/proc/self/clear_refs").write_text("5")  # the peak counts from here
    before = _status_bytes("VmRSS")
    loaded = trainable_layers(spec, run, stage=stage)
    rise = _status_bytes("VmHWM") - before
    return {"rise": rise, "bound": bound, "layers": len(loaded)}


def run_stages(overrides: list[str]) -> int:
    stages = [o.split("=", 1)[1] for o in overrides if o.startswith("pipeline.stages=")]
    return int(stages[-1]) if stages else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
