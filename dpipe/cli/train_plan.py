"""`dpipe-train --plan [--machine NxG[,host=H][,disk=D]] [overrides]`: the plan of a run, printed
without starting a worker (dpipe.plan): on the GPUs this machine has, or on an emulated machine.
And `pipeline=auto`: the plan's keys applied to the run's config before it starts.

Exit status 0 when the plan fits, 1 when it does not (the output names the smallest change that
would), 2 for a mistake in the command.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dpipe.errors import ConfigError


@dataclass(frozen=True)
class PlanRequest:
    machine: object  # --machine's (dpipe.plan.machine.Machine); None: the GPUs this process sees


def take_plan_options(argv: list[str]) -> tuple[list[str], PlanRequest | None]:
    """argv without `--plan` and `--machine X` (or `--machine=X`), and the request they make
    (None without `--plan`)."""
    out, machine, plan = [], None, False
    args = iter(argv)
    for arg in args:
        if arg == "--plan":
            plan = True
        elif arg == "--machine":
            machine = next(args, None)
            if machine is None:
                raise ConfigError("--machine needs a value, e.g. --machine 1x24,host=64")
        elif arg.startswith("--machine="):
            machine = arg.split("=", 1)[1]
        else:
            out.append(arg)
    if machine is not None and not plan:
        raise ConfigError("--machine goes with --plan (dpipe-train --plan --machine 1x24 ...)")
    if not plan:
        return out, None
    from dpipe.plan.machine import parse

    return out, PlanRequest(None if machine is None else parse(machine))


def fixed_keys(hydra_cfg) -> set[str]:
    from dpipe.config.experiments import preset_keys
    from dpipe.plan.for_run import user_keys

    experiment = hydra_cfg.runtime.choices.get("experiment")
    return user_keys(list(hydra_cfg.overrides.task),
                     preset_keys(experiment) if experiment else set())


def plan_machine(cfg, request: PlanRequest | None, visible=None):
    """The machine the run's plan is for: `--plan --machine`'s, else the GPUs this process sees
    (`visible`, None where it sees none), else the config's `pipeline.machine` (the machine an
    experiment preset targets); None where there is none of them."""
    if request is not None and request.machine is not None:
        return request.machine
    if visible is not None:
        return visible
    if cfg.pipeline.machine is not None:
        from dpipe.plan.machine import parse

        return parse(str(cfg.pipeline.machine), "pipeline.machine")
    return None


def print_plan(run, spec, hydra_cfg, machine) -> int:
    """Prints the plan for `machine` (`plan_machine`'s); exit status 0 where it fits, else 1."""
    from dpipe.plan.change import smallest_change
    from dpipe.plan.for_run import plan_run
    from dpipe.plan.report import describe

    if machine is None:
        raise ConfigError("--plan: no GPU is visible here; give the machine to plan for, "
                          "e.g. --machine 1x24,host=64 (or pipeline.machine, as the "
                          "experiment presets do)")
    fixed = fixed_keys(hydra_cfg)
    rp = plan_run(spec, run, machine, fixed)
    change = None if rp.plan.fits else smallest_change(
        rp.footprint, run, machine, fixed, rp.resolution, files=rp.files)
    print(describe(rp, change), flush=True)
    return 0 if rp.plan.fits else 1


def planned_before(cfg, hydra_cfg, run_dir: Path) -> str | None:
    """On resuming a pipeline=auto run from a checkpoint: the plan's keys as its earlier start
    chose them (`<run>/run.yaml`), so the checkpoint's layout holds whatever memory is free now;
    the keys the user sets now stay as they are. Returns the line to log; None where there is
    nothing to keep (not pipeline=auto, not resuming, no checkpoint yet)."""
    from omegaconf import OmegaConf, open_dict

    from dpipe.config.run_name import RUN_CONFIG
    from dpipe.plan.choose import PLANNED_KEYS
    from dpipe.train.checkpoint import newest_complete

    saved = run_dir / RUN_CONFIG
    if not (cfg.pipeline.auto and cfg.train.resume and saved.is_file()
            and newest_complete(run_dir)):
        return None
    before, fixed, kept = OmegaConf.load(saved), fixed_keys(hydra_cfg), []
    with open_dict(cfg):
        for key in PLANNED_KEYS:
            if key not in fixed:
                value = OmegaConf.select(before, key)
                OmegaConf.update(cfg, key, value)
                kept.append(f"{key}={value}")
    return ("pipeline=auto: resuming, so the plan of the run's earlier start (its run.yaml) "
            "stays: " + " ".join(kept))


def apply_auto_pipeline(cfg, hydra_cfg, machine, world: int | None = None) -> str | None:
    """With pipeline=auto on a machine with GPUs: sets the plan's keys in `cfg` (the keys the
    user set stay as they are) and returns the plan's description to log; refuses a run that
    nothing fits, naming the numbers and the smallest change. None where there is nothing to do
    (another pipeline, or no GPU: the keys of conf/pipeline/auto.yaml run as they are). `world`:
    the processes torchrun or SLURM started, which the plan's layout must use, all of them."""
    from omegaconf import OmegaConf, open_dict

    from dpipe.config.checks import validate
    from dpipe.models.registry import build_spec
    from dpipe.plan.change import smallest_change
    from dpipe.plan.for_run import plan_run
    from dpipe.plan.report import describe

    if not cfg.pipeline.auto or machine.gpus == 0:
        return None
    run = validate(cfg)
    fixed = fixed_keys(hydra_cfg)
    rp = plan_run(build_spec(run.model), run, machine, fixed, world=world)
    if not rp.plan.fits:
        change = smallest_change(rp.footprint, run, machine, fixed, rp.resolution,
                                 files=rp.files, world=world)
        raise ConfigError(
            f"pipeline=auto: nothing fits {machine.name}: {'; '.join(rp.plan.problems)}"
            + (f"; the smallest change that fits: {change[0]}" if change else
               "; no single change tried fits (dpipe-train --plan shows the plan)"))
    with open_dict(cfg):
        for override in rp.plan.overrides:
            key, value = override.split("=", 1)
            if key not in fixed:
                OmegaConf.update(cfg, key, value if not value.isdigit() else int(value))
    return "pipeline=auto:\n" + describe(rp)


def check_fits(run, spec, machine, data_parallel: int, run_dir: Path | None = None) -> str:
    """Refuses a run, before any worker starts, that cannot fit `machine` whatever its
    activations turn out to be: its stages' weights and trained state alone over the GPU
    budget, its loading over the host's memory, its cache over the disk's free space. Returns
    the prediction's summary line to log (the activations' part is an estimate: the memory plan
    measures them in the first step)."""
    from dpipe.plan.change import gib
    from dpipe.plan.for_run import run_layout
    from dpipe.plan.machine import size
    from dpipe.pipeline.memory import fragmentation_margin

    rp = run_layout(spec, run, machine, data_parallel)
    plan = rp.plan
    certain = [p for p in plan.problems if "GPU memory" not in p]
    for i, s in enumerate(plan.stage_plans):
        floor = s.weights + s.trainable + fragmentation_margin(plan.budget)
        if floor > plan.budget:
            certain.append(f"stage {i}'s weights and trained state alone take {gib(floor)} GiB "
                           f"with the margin, {gib(plan.budget)} GiB per GPU are free")
    if certain:
        raise ConfigError(f"this run does not fit {machine.name}: {'; '.join(certain)}; "
                          "`dpipe-train --plan pipeline=auto ...` (same overrides) shows a "
                          "plan that fits, or pipeline=auto applies it")
    if run_dir is not None:  # the prediction the run's end compares with (<run>/plan.json)
        from dpipe.train.plan_file import write_launch_prediction

        write_launch_prediction(run_dir, [s.peak for s in plan.stage_plans], plan.disk,
                                plan.loading_per_process)
    step, host = plan.host_peak
    peaks = " / ".join(gib(s.peak) for s in plan.stage_plans)
    cache = f"cache {size(plan.disk)}" if plan.disk is not None else "cache not known"
    return (f"plan: predicted GPU peak per stage {peaks} GiB of {gib(plan.budget)}; "
            f"host {gib(host)} GiB ({step}); {cache}")
