"""`dpipe-train --plan [--machine NxG[,host=H][,disk=D]] [overrides]`: the plan of a run, printed
without starting a worker (dpipe.plan): on the GPUs this machine has, or on an emulated machine.

Exit status 0 when the plan fits, 1 when it does not (the output names the smallest change that
would), 2 for a mistake in the command.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def print_plan(run, spec, hydra_cfg, request: PlanRequest) -> int:
    from pathlib import Path

    from dpipe.plan import machine as machines
    from dpipe.plan.change import smallest_change
    from dpipe.plan.for_run import plan_run
    from dpipe.plan.report import describe

    machine = request.machine
    if machine is None:
        machine = machines.visible(Path(run.dataset.cache_dir).expanduser())
        if machine.gpus == 0:
            raise ConfigError("--plan: no GPU is visible here; give the machine to plan for, "
                              "e.g. --machine 1x24,host=64")
    fixed = fixed_keys(hydra_cfg)
    rp = plan_run(spec, run, machine, fixed)
    change = None if rp.plan.fits else smallest_change(
        rp.footprint, run, machine, fixed, rp.resolution, files=rp.files)
    print(describe(rp, change), flush=True)
    return 0 if rp.plan.fits else 1
