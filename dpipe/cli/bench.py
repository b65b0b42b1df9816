"""`dpipe-bench`: time training configurations of a real-size model with random weights.

    dpipe-bench --size dev --plain \
        --run "lora-1gpu: pipeline=single pipeline.micro_batches=8 train.precision=bf16 \
               model.lora.rank=32 pipeline.compile=true"

Each `--run NAME: OVERRIDES` is composed like `dpipe-train OVERRIDES` (model=flux by default) and
runs through the same layers, pipeline engine and `train_batch` as training, in its own worker
processes, on fixed random micro-batches. `--plain` adds the reference: a plain one-GPU loop
(compiled blocks, no checkpointing) on the first run's model and batch. Prints s/step, images/s,
model TFLOP/s and MFU per GPU (by the model-FLOP convention), the TFLOP/s the step executes
(`dpipe.train.flops`), peak memory, per-stage compute and idle time, and every step's loss
(NaN is flagged: a kernel that trains to NaN shows in its benchmark).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from dpipe.bench.overrides import bench_overrides
from dpipe.config.checks import validate
from dpipe.config.compose import compose_config
from dpipe.config.schema import RunConfig
from dpipe.errors import UserError
from dpipe.launch.local import launch_workers, world_size_for
from dpipe.launch.quiet import quiet_libraries
from dpipe.launch.run_rank import save_run_config
from dpipe.models.registry import build_spec

PEAK_TFLOPS = 790.0  # measured bf16 dense matmul rate of an H200 here (see docs/performance.md)


def arg_parser() -> argparse.ArgumentParser:
    """dpipe-bench's arguments; tests/unit/test_docs_commands.py checks the docs with it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--size", default="dev", help="the model size (flux: dev, schnell; "
                        "hunyuan_video: 13b; hidream: i1; z_image: 6b; lumina2: 2b; "
                        "qwen_image: 20b; hunyuan_video15: 8b; wan: 14b; krea2: 12b; "
                        "ideogram4: 9b (2048x2048), 9b-1024; ernie_image: 8b; ltx23: 22b; omnigen2: 4b; "
                        "every family that has sizes: tiny)")
    parser.add_argument("--run", action="append", required=True, metavar="NAME: OVERRIDES")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plain", action="store_true", help="also time the plain reference loop")
    parser.add_argument("--out", default="outputs/bench", help="results folder")
    parser.add_argument("--loader", action="store_true",
                        help="feed the steps through the training data loader (noise drawn per "
                             "step, train.loader_workers processes) instead of fixed batches")
    parser.add_argument("--memory-cap-gb", type=float, default=None,
                        help="emulate a smaller GPU: cap each process's allocations (GiB)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more step: its kernel time by kind, per rank, in "
                             "OUT/NAME/profile_rank<N>.txt (dpipe.bench.profile)")
    return parser


def bench_run(overrides: list[str], visible, memory_cap_gb: float | None) -> RunConfig:
    """One `--run`'s config, composed as dpipe-train composes it. Under pipeline=auto (every
    experiment preset) with the plan's keys, as dpipe-train sets them: for `visible` (the GPUs
    here, a `dpipe.plan.machine.Machine`), each taken as a card of `memory_cap_gb` where that is
    set (its free memory: the cap less the CUDA context, as on such a card), else for the
    preset's `pipeline.machine`."""
    from dataclasses import replace

    from dpipe.cli.train_plan import apply_auto_pipeline, plan_machine
    from dpipe.plan.machine import CONTEXT_GIB

    cfg = compose_config(bench_overrides(overrides))
    if cfg.pipeline.auto:
        if visible is not None and memory_cap_gb:
            visible = replace(visible, gpu_gib=min(visible.gpu_gib, memory_cap_gb - CONTEXT_GIB))
        apply_auto_pipeline(cfg, cfg.hydra, plan_machine(cfg, None, visible))
    return validate(cfg)


def main() -> None:
    quiet_libraries()
    args = arg_parser().parse_args()

    import torch

    from dpipe.bench.worker import require_size

    gpus = torch.cuda.device_count()
    if gpus == 0 and args.size != "tiny":
        sys.exit("error: dpipe-bench measures GPU training; no CUDA device is visible "
                 "(--size tiny runs a CPU smoke test of the same path)")
    out = Path(args.out)
    rows = []
    for spec in args.run:
        name, _, overrides = spec.partition(":")
        name = name.strip()
        visible = None
        if gpus:
            from dpipe.plan.machine import visible as visible_machine

            visible = visible_machine(Path(args.out).resolve())
        try:
            run = bench_run(overrides.split(), visible, args.memory_cap_gb)
        except UserError as err:
            sys.exit(f"error: --run {name}: {err}")
        model = build_spec(run.model)
        require_size(model, args.size)
        if args.plain and model.plain_loop_unfit:
            sys.exit(f"error: --plain: {model.plain_loop_unfit}; leave out --plain for "
                     f"model.family={model.family}")
        world = world_size_for(run, gpus)
        run_dir = out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        for old in run_dir.glob("rank*.json"):
            old.unlink()
        save_run_config(run, run_dir)
        (run_dir / "bench.json").write_text(json.dumps(
            {"size": args.size, "warmup": args.warmup, "steps": args.steps,
             "loader": args.loader, "memory_cap_gb": args.memory_cap_gb,
             "profile": args.profile}))
        print(f"== {name}: {overrides.strip()} ({world} GPUs)", flush=True)
        code = launch_workers(run_dir, world, module="dpipe.bench.worker")
        if code:
            rows.append({"name": name, "error": f"exit {code}"})
            continue
        ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
        rows.append(_row(name, overrides.strip(), ranks))
        if args.plain and len(rows) == 1:
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
            done = subprocess.run([sys.executable, "-m", "dpipe.bench.plain", str(run_dir)], env=env)
            if done.returncode:  # e.g. out of memory: the rows measured so far still count
                rows.append({"name": "plain loop (reference)", "error": f"exit {done.returncode}"})
                continue
            plain = json.loads((run_dir / "plain.json").read_text())
            rows.append(_row("plain loop (reference)", "diffusers forward, compiled blocks, "
                             "no checkpointing", [dict(plain, rank=0, stage=0, peak_gib=plain["peak_gib"])]))
    table = _table(rows)
    print(table)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=2))


def _row(name: str, overrides: str, ranks: list[dict]) -> dict:
    step_s = max(r["step_s"] for r in ranks)
    gpus = len(ranks)
    tflops = ranks[0]["flops_per_step"] / step_s / gpus / 1e12
    executed = ranks[0].get("executed_flops_per_step")  # the plain loop's is not counted
    executed_tflops = None if executed is None else executed / step_s / gpus / 1e12
    stages = sorted({r["stage"] for r in ranks})
    per_stage = []
    for stage in stages:
        r = next(x for x in ranks if x["stage"] == stage)
        if "forward_ms" in r:
            compute = (r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"]) / 1000
            per_stage.append({"stage": stage, "layers": r["layers"], "compute_s": compute,
                              "idle_s": step_s - compute, "peak_gib": r["peak_gib"],
                              "peak_reserved_gib": r.get("peak_reserved_gib", float("nan")),
                              "checkpointed": f'{r["checkpointed_layers"]}/{r["local_layers"]}'})
        else:
            per_stage.append({"stage": stage, "peak_gib": r["peak_gib"]})
        if "host_syncs_per_step" in r:
            per_stage[-1].update(host_syncs=r["host_syncs_per_step"],
                                 backward_passes=r["backward_passes_per_micro_batch"])
    return {"name": name, "overrides": overrides, "gpus": gpus, "step_s": step_s,
            "images_per_s": ranks[0]["images_per_step"] / step_s,
            "s_per_image": step_s / ranks[0]["images_per_step"], "tflops_per_gpu": tflops,
            "mfu": tflops / PEAK_TFLOPS, "executed_tflops_per_gpu": executed_tflops,
            "losses": ranks[0].get("losses"), "stages": per_stage}


def _table(rows: list[dict]) -> str:
    lines = ["| run | GPUs | s/step | images/s | s/image | TFLOP/s per GPU | MFU | executed TFLOP/s per GPU (of the peak) | per stage: compute s / idle s / peak GiB (reserved) / recomputed layers | per stage: host syncs per step / backward passes per micro-batch | losses (warm-up, timed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | | | | |")
            continue
        stages = "; ".join(
            f"{s['stage']}: {s.get('compute_s', float('nan')):.2f} / {s.get('idle_s', float('nan')):.2f} / "
            f"{s['peak_gib']:.1f} ({s.get('peak_reserved_gib', float('nan')):.1f}) / "
            f"{s.get('checkpointed', '-')}" for s in r["stages"])
        audit = "; ".join(f"{s['stage']}: {s['host_syncs']} / {s['backward_passes']:g}"
                          for s in r["stages"] if "host_syncs" in s)
        lines.append(f"| {r['name']} | {r['gpus']} | {r['step_s']:.3f} | {r['images_per_s']:.2f} | "
                     f"{r['s_per_image']:.3f} | {r['tflops_per_gpu']:.0f} | {r['mfu']:.0%} | "
                     f"{_executed(r['executed_tflops_per_gpu'])} | {stages} | "
                     f"{audit} | {_losses(r['losses'])} |")
    return "\n".join(lines)


def _losses(losses: list[float] | None) -> str:
    """Every step's loss; "NOT FINITE" first where one is NaN or infinite."""
    if not losses:
        return "-"  # the plain loop's are not reported
    shown = " ".join(f"{x:.4g}" for x in losses)
    return shown if all(math.isfinite(x) for x in losses) else f"NOT FINITE: {shown}"


def _executed(tflops: float | None) -> str:
    return "-" if tflops is None else f"{tflops:.0f} ({tflops / PEAK_TFLOPS:.0%})"


if __name__ == "__main__":
    main()
