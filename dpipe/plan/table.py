"""The plan for each of a table of emulated machines and real-size models (docs/performance.md's
plan table, `scripts/plan_table.py`; tests/unit/test_plan.py checks it is consistent)."""

from __future__ import annotations

import functools

from dpipe.plan.change import gib
from dpipe.plan.choose import Plan, choose
from dpipe.plan.footprint import ModelFootprint, measure
from dpipe.plan.machine import parse

# name: (overrides, benchmark size, resolution, frames). The video rows at the presets' 480x832
# area (632^2), 33 frames; LTX-2.3 with its sound at 768^2 x 121 frames (5 s at 24 fps).
MODELS = {
    "FLUX.1-dev LoRA": (["model=flux"], "dev", 1024, 1),
    "Wan 2.1 14B LoRA": (["model=wan", "dataset.resolutions=[632]",
                          "dataset.frame_buckets=[1,33]"], "14b", 632, 33),
    "Qwen-Image 20B LoRA": (["model=qwen_image"], "20b", 1024, 1),
    "HunyuanVideo 13B LoRA": (["model=hunyuan_video", "dataset.resolutions=[632]",
                               "dataset.frame_buckets=[1,33]"], "13b", 632, 33),
    "LTX-2.3 22B LoRA, with sound": (["model=ltx23", "model.audio=true",
                                      "dataset.resolutions=[768]",
                                      "dataset.frame_buckets=[1,121]"], "22b", 768, 121),
    # Full fine-tune with bf16 weights and AdamW states (no fp32 master copy: ZeRO-1, which a
    # master copy needs in bf16, would shard the state over replicas, which the plan does not
    # model yet).
    "FLUX.1-dev full fine-tune": (["model=flux", "model.mode=full",
                                   "optim.master_weights=false"], "dev", 1024, 1),
}
COMMON = ["model.path=/models/x", "train.precision=bf16", "pipeline.micro_batches=8"]
MACHINES = [f"{gpus},host={host}" for gpus in ("1x16", "1x24", "2x24", "4x24", "1x80", "8x80")
            for host in (32, 64, 128)]


@functools.cache
def model_run(name: str):
    from dpipe.config.compose import compose_config, compose_run

    overrides = [*MODELS[name][0], *COMMON, "pipeline=single"]
    cfg = compose_config(overrides)
    return compose_run(overrides, world_size=cfg.pipeline.stages)


@functools.cache
def footprint(name: str) -> ModelFootprint:
    from dpipe.models.registry import build_spec

    run = model_run(name)
    _, size, resolution, frames = MODELS[name]
    return measure(build_spec(run.model), run, size, resolution, frames)


def plan(name: str, machine: str) -> Plan:
    return choose(footprint(name), model_run(name), parse(machine))


# Each experiment preset (conf/experiment/) and the row of MODELS it trains, at its size.
PRESETS = {"flux_lora_16gb": "FLUX.1-dev LoRA", "flux_lora_24gb": "FLUX.1-dev LoRA",
           "wan14b_lora_24gb": "Wan 2.1 14B LoRA", "qwen_image_lora_24gb": "Qwen-Image 20B LoRA",
           "hunyuan_video_lora_2x24gb": "HunyuanVideo 13B LoRA"}


def preset_plan(preset: str) -> Plan:
    """The plan a preset runs on the machine it names (its pipeline.machine), where no GPU is
    visible: what `dpipe-train --plan experiment=<preset>` prints."""
    from dpipe.config.compose import compose_run

    run = compose_run([f"experiment={preset}", "model.path=/models/x"])
    return choose(footprint(PRESETS[preset]), run, parse(run.pipeline.machine, "pipeline.machine"))


def describe_row(name: str, machine: str, p: Plan | None = None) -> str:
    p = plan(name, machine) if p is None else p
    if not p.fits:
        return f"| {name} | {machine} | does not fit: {'; '.join(p.problems)} | | | |"
    recompute = sum(s.recompute for s in p.stage_plans)
    swap = sum(s.swap for s in p.stage_plans)
    step, host = p.host_peak
    return (f"| {name} | {machine} | {p.stages} x {p.data_parallel}, {p.base}, recompute "
            f"{recompute}, swap {swap} | {' / '.join(gib(s.peak) for s in p.stage_plans)} | "
            f"{gib(host)} ({step.split(' (')[0]}) | {p.seconds_per_sample:.2f} |")


def markdown(host: int = 128) -> str:
    """The rows of the machines with `host` GiB of host memory: with less, a row fits where its
    host peak does (the plan then may use fewer replicas: `MACHINES` holds 32 and 64 too)."""
    lines = ["| model | machine (GPUs x GiB, host GiB) | stages x replicas, base, layers "
             "recomputed / swapped | GPU peak GiB per stage | host peak GiB (step) | "
             "s/sample (est.) |", "|---|---|---|---|---|---|"]
    lines += [describe_row(name, machine) for name in MODELS for machine in MACHINES
              if machine.endswith(f"host={host}")]
    return "\n".join(lines)


def preset_markdown() -> str:
    """The plan of each preset on its machine (its micro-batches per step, not the 8 above)."""
    lines = ["| preset | machine (its pipeline.machine) | stages x replicas, base, layers "
             "recomputed / swapped | GPU peak GiB per stage | host peak GiB (step) | "
             "s/sample (est.) |", "|---|---|---|---|---|---|"]
    from dpipe.config.compose import compose_config

    for preset in PRESETS:
        machine = compose_config([f"experiment={preset}"]).pipeline.machine
        lines.append(describe_row(f"`{preset}`", machine, preset_plan(preset)))
    return "\n".join(lines)
