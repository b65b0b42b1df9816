"""`dpipe-train [overrides]`: compose the run config, check it, start the workers, train.

    dpipe-train                                   # the tiny demo: 2 stages in 2 CPU processes
    dpipe-train --cfg job model=flux pipeline=four_stage optim.lr=2e-5   # print the config
    dpipe-train --plan --machine 1x24 model=flux model.path=/models/FLUX.1-dev   # will it fit?
    dpipe-train -m optim.lr=1e-4,5e-5             # a sweep, one run dir per point
    dpipe-train cluster=slurm_gpu optim.lr=1e-4,5e-5   # the same sweep as a SLURM job array

Started by dpipe itself, by torchrun, or in SLURM tasks (via submitit, see docs/cluster.md): in
the last two cases the ranks come from the environment and no workers are started.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dpipe.launch import env as dist_env
from dpipe.launch import user_stop

if dist_env.from_environ() is None and (
        __name__ == "__main__" or Path(sys.argv[0]).name == "dpipe-train"):
    # dpipe-train's own process, not one rank of a torchrun/srun launch nor an importer: a stop
    # during the imports below (seconds of torch and Hydra) ends it with one line.
    user_stop.install()

import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402
from dataclasses import replace  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from dpipe.config.checks import unknown_key_message, validate
from dpipe.launch.prestart import check_before_workers  # noqa: E402
from dpipe.cli.train_help import help_text, wants_help  # noqa: E402
from dpipe.cli.train_plan import (apply_auto_pipeline, check_fits, plan_machine,  # noqa: E402
                                  planned_before, print_plan, take_plan_options)
from dpipe.config.default_pipeline import fit_default_pipeline  # noqa: E402
from dpipe.config.experiments import preset_overrides  # noqa: E402
from dpipe.config.store import register_schemas  # noqa: E402
from dpipe.config.unknown_option import unknown_option_message  # noqa: E402
from dpipe.errors import UserError  # noqa: E402
from dpipe.launch import run_lock  # noqa: E402
from dpipe.launch.quiet import quiet_libraries  # noqa: E402
from dpipe.io import atomic_write_text  # noqa: E402
from dpipe.launch.local import ERRORS_DIR, Stopped, launch_workers, world_size_for  # noqa: E402
from dpipe.launch.run_rank import run_rank, save_run_config, train_job  # noqa: E402
from dpipe.launch.sweep import register_launchers  # noqa: E402
from dpipe.sample.requests import sample_requests  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
log = logging.getLogger("dpipe")


def train_task(cfg: DictConfig) -> int:
    """Hydra's task function: one run (or one point of a sweep)."""
    _restore_hydra_errors()  # from here Hydra reports the errors it meets as it always did
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweep_point = hydra_cfg.mode == RunMode.MULTIRUN
    env = dist_env.from_environ()
    if env is not None:  # torchrun or a SLURM task: this process is one of the ranks
        return _run_as_rank(cfg, run_dir, env)
    lock = None
    try:
        import torch

        gpus = torch.cuda.device_count()
        fitted = fit_default_pipeline(cfg, hydra_cfg, gpus)
        from dpipe.plan.machine import visible

        # --machine, else the GPUs here, else the machine a preset targets (pipeline.machine).
        planning = cfg.pipeline.auto or _PLAN_REQUEST is not None
        machine = plan_machine(cfg, _PLAN_REQUEST,
                               visible(_cache_dir(cfg)) if gpus and planning else None)
        if _PLAN_REQUEST is not None:  # --plan: print it; no run dir, no worker
            from dpipe.models.registry import build_spec

            run = validate(cfg)
            return _exit_on_failure(print_plan(run, build_spec(run.model), hydra_cfg, machine))
        planned = None
        if cfg.pipeline.auto and machine is not None:
            planned = planned_before(cfg, hydra_cfg, run_dir) or \
                apply_auto_pipeline(cfg, hydra_cfg, machine)
        run = validate(cfg)
        # Before anything reads or writes the run dir: a second run on it stops here.
        lock = run_lock.acquire(run_dir)
        save_hydra_files(cfg, run_dir)
        from dpipe.models.registry import build_spec

        from dpipe.train import checkpoint

        for line in (fitted, planned):
            if line is not None:
                log.info(line)
        world = world_size_for(run, torch.cuda.device_count())
        if run.train.resume:  # an incompatible checkpoint fails before any worker starts
            checkpoint.check_resume(run_dir, run_yaml(run),
                                    unverified_ok=run.train.resume_unverified)
        spec = build_spec(run.model)
        spec.ensure_available()  # a bad model path fails before any worker starts
        # So does a bad sample.prompts item.
        requests = sample_requests(run.sample, spec, run.dataset)
        if requests:  # as the prompts were parsed: an unquoted comma splits a prompt in two
            log.info("sample prompts: %s", " | ".join(repr(r.prompt) for r in requests))
        done = _finished_message(run, run_dir, lambda: requests)
        if done is not None:  # nothing to train: no worker starts, nothing is rewritten
            print(done, flush=True)
            return 0
        check_before_workers(run, run_dir, spec)
        if torch.cuda.device_count():  # also records the prediction in <run>/plan.json
            from dpipe.plan.machine import visible

            fits = check_fits(run, spec, visible(_cache_dir(cfg)), world // run.pipeline.stages,
                              run_dir)
            if planned is None:  # pipeline=auto logged its plan already
                log.info(fits)
        else:  # a fresh record all the same: the workers' estimates go in it
            from dpipe.train.plan_file import write_launch_prediction

            write_launch_prediction(run_dir, None, None)
        save_run_config(run, run_dir)
        log.info("run dir: %s; starting %d worker processes", run_dir, world)
        code = launch_workers(run_dir, world, graceful_stop=True)
    except UserError as err:
        if sweep_point:
            raise  # the launcher records it and goes on with the next point
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except Stopped as stop:  # a sweep stops too: the user stopped this process
        print(_stopped_message(run_dir, stop), file=sys.stderr, flush=True)
        sys.exit(128 + stop.signum)
    finally:
        if lock is not None:  # the workers have ended: the next point or run may take it
            lock.release()
    if code and sweep_point:
        raise RuntimeError(_first_error(run_dir) or f"a worker process exited with code {code}")
    return _exit_on_failure(code)


def _stopped_message(run_dir: Path, stop: Stopped) -> str:
    from dpipe.train import checkpoint

    name = signal.Signals(stop.signum).name
    saved = checkpoint.newest_complete(run_dir)
    resume = "run the same command to resume"
    if stop.forced:
        where = (f"the newest checkpoint is {saved[1]} (step {saved[0]})" if saved
                 else "no checkpoint yet")
        return f"stopped at once on a second {name}: workers killed; {where}; {resume}"
    if saved is None:  # the workers ended before a first step (e.g. one failed to start)
        return f"stopped on {name} before a first checkpoint"
    return f"stopped at step {saved[0]} on {name}: checkpoint {saved[1]}; {resume}"


def _run_as_rank(cfg: DictConfig, run_dir: Path, env: dist_env.DistEnv) -> int:
    """One rank of a run whose processes someone else started (torchrun, srun via submitit).

    Any failure ends this process with a non-zero status, never a return: the other ranks may be
    blocked in a collective, and srun's --kill-on-bad-exit stops them when one rank exits so.
    """
    from dpipe.train import checkpoint, preemption

    env = dist_env.reachable_master(env)  # a SLURM node name that does not resolve: its NodeAddr
    dist_env.export(env)
    try:
        import torch

        # The processes someone started on GPUs (one per GPU) are the GPUs this run has.
        gpus = env.world_size if torch.cuda.is_available() else 0
        fitted = fit_default_pipeline(cfg, HydraConfig.get(), gpus)
        if cfg.pipeline.auto and gpus:  # the same plan on every rank: from total memory
            from dpipe.plan.machine import visible

            planned = planned_before(cfg, HydraConfig.get(), run_dir) or \
                apply_auto_pipeline(cfg, HydraConfig.get(),
                                    replace(visible(_cache_dir(cfg), free=False), gpus=gpus),
                                    world=env.world_size)
            fitted = planned if fitted is None else f"{fitted}\n{planned}"
        if fitted is not None and env.is_main:
            log.info(fitted)
        run = validate(cfg, world_size=env.world_size)
        if env.is_main:  # the one owner of the run dir in this process group; held until exit
            run_lock.acquire(run_dir)
            save_hydra_files(cfg, run_dir)
        if run.train.resume:
            # The same config verdict on every rank; the main rank alone reads the files (rank
            # 0 of training reuses its verdict, dpipe.train.checkpoint.VERDICTS).
            checkpoint.check_resume(run_dir, run_yaml(run), verify=env.is_main,
                                    unverified_ok=run.train.resume_unverified)
        from dpipe.models.registry import build_spec

        # The sample requests are made only for a finished run: they read the model's files,
        # which a tiny model's first run has not created yet.
        done = _finished_message(
            run, run_dir, lambda: sample_requests(run.sample, build_spec(run.model), run.dataset))
        if done is not None:  # every rank reads the same files: all return, none waits
            if env.is_main:
                print(done, flush=True)
            return 0
        if env.is_main:
            save_run_config(run, run_dir)
        preemption.install()  # SLURM's time-limit signal -> checkpoint + requeue (submitit only)
        code = run_rank(train_job(run, run_dir), run_dir)
    except run_lock.RunDirBusy as err:  # not recorded in the run dir: it is the holder's
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except UserError as err:
        _record_error(run_dir, env.rank, str(err))
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as err:
        traceback.print_exc()
        _record_error(run_dir, env.rank, f"rank {env.rank} crashed: {type(err).__name__}: {err}")
        sys.exit(1)
    return _exit_on_failure(code)


def _cache_dir(cfg: DictConfig) -> Path:
    return Path(cfg.dataset.cache_dir).expanduser()


def _finished_message(run, run_dir: Path, requests_of) -> str | None:
    """The one line that a run with nothing left to do prints instead of training (None if it
    has something to do). Started again, such a run would start every worker to train no step
    and rewrite its export. Its final sampling round must be complete too: a run killed while
    sampling, or given new sample.prompts, makes the missing samples."""
    from dpipe.config.schema import TrainMode
    from dpipe.sample.training import round_dir
    from dpipe.train import checkpoint
    from dpipe.train.export import export_dir

    if not run.train.resume:
        return None
    export = export_dir(run_dir, run.model.mode == TrainMode.lora)
    step = checkpoint.finished_run(run_dir, run.train.max_steps, export)
    if step is None:
        return None
    if run.sample.prompts or run.sample.prompts_file:
        folder = round_dir(run_dir, step)
        if not all((folder / f"{r.index}.png").is_file() or (folder / f"{r.index}.mp4").is_file()
                   for r in requests_of()):
            return None
    return (f"{run_dir} is complete at step {step}: its outputs are in {export} (and "
            f"{run_dir}'s checkpoints/, metrics.jsonl); add `train.max_steps=M` (M > {step}) to "
            f"continue it, or `name=...` (another name, or `hydra.run.dir=...`) for a new run")


def save_hydra_files(cfg: DictConfig, run_dir: Path) -> None:
    """What Hydra keeps of a run in <run>/.hydra/: the composed config, Hydra's own config and
    the command line's overrides (as `hydra.output_subdir` would, which dpipe sets to null so
    that a run the lock refuses writes nothing)."""
    hydra_cfg = HydraConfig.get()
    folder = run_dir / ".hydra"
    atomic_write_text(folder / "config.yaml", OmegaConf.to_yaml(cfg))
    atomic_write_text(folder / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})))
    atomic_write_text(folder / "overrides.yaml",
                      OmegaConf.to_yaml(OmegaConf.create(list(hydra_cfg.overrides.task))))


def run_yaml(run) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(run))


def _record_error(run_dir: Path, rank: int, message: str) -> None:
    """Where launchers find why a rank failed (dpipe.launch.jobs reads it)."""
    try:
        atomic_write_text(run_dir / ERRORS_DIR / f"rank{rank:05d}.txt", message)
    except OSError:
        pass


def _first_error(run_dir: Path) -> str:
    folder = run_dir / ERRORS_DIR
    for path in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
        if path.read_text().strip():
            return path.read_text().strip()
    return ""


def _exit_on_failure(code: int) -> int:
    if code:
        sys.exit(code)
    return code


def main() -> None:
    user_stop.raise_from_now()
    try:
        _main()
    except user_stop.StopRequested as stop:  # before any worker started (or after they ended)
        print(user_stop.message(stop.signum), file=sys.stderr, flush=True)
        sys.exit(128 + stop.signum)


def _main() -> None:
    if wants_help(sys.argv[1:]):  # dpipe's help, not Hydra's (which suggests `+key=`)
        print(help_text(Path(CONF_DIR)), end="")
        return
    global _PLAN_REQUEST
    try:  # `+experiment=x` as `experiment=x`; a preset name that is not one, refused here
        args, _PLAN_REQUEST = take_plan_options(sys.argv[1:])
        sys.argv = [sys.argv[0], *preset_overrides(args)]
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.argv = _resolving_printed_config(sys.argv)
    quiet_libraries()
    register_schemas()
    register_launchers()
    # Hydra would write the run dir's .hydra/ files before the task, even for a run that the run
    # lock then refuses: the task writes them once it holds the lock (save_hydra_files).
    extra = ["hydra.output_subdir=null"]
    if dist_env.process_rank() != 0:
        # Under torchrun or srun every rank composes the config, but only rank 0 owns the run dir.
        extra += ["hydra/job_logging=none", "hydra/hydra_logging=none"]
    sys.argv = _with_overrides(sys.argv, extra)
    hydra_main = hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
    _run_hydra(hydra_main(train_task))


def _resolving_printed_config(argv: list[str]) -> list[str]:
    """`--cfg job` (or `all`) as `--cfg job --resolve`: the config as the run gets it, `name`
    (the run dir's name, which Hydra's own choices make) included. `--cfg hydra` stays as it
    is: Hydra's config alone cannot resolve what refers to the run's keys."""
    printed = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("--cfg", "-c")]
    if any(p in ("job", "all") for p in printed) and "--resolve" not in argv:
        return [*argv, "--resolve"]
    return argv


def _with_overrides(argv: list[str], extra: list[str]) -> list[str]:
    """argv with `extra` overrides next to the user's own: argparse takes one run of positional
    arguments, so appended after `a=1 --cfg job` they would be refused as unrecognized."""
    for i, arg in enumerate(argv[1:], start=1):
        if "=" in arg and not arg.startswith("-"):
            return [*argv[:i + 1], *extra, *argv[i + 1:]]
    return [*argv, *extra]


# `--plan` (dpipe.cli.train_plan): the task prints the run's plan instead of running it.
_PLAN_REQUEST = None

# Whether the user set HYDRA_FULL_ERROR (then Hydra's errors are theirs to read, untouched).
_USER_FULL_ERROR = "HYDRA_FULL_ERROR" in os.environ


def _run_hydra(hydra_main) -> None:
    """Runs Hydra, telling the mistakes it meets before the task starts in one line.

    Hydra reports what fails while it reads the config files and makes the run dir with a
    traceback for anything not its own: a YAML syntax error in a config file (conf/local/, a
    --config-dir), a run dir under a file or unwritable. With HYDRA_FULL_ERROR set it raises
    instead, to here: so it is set until the task starts (`_restore_hydra_errors`), and what
    is not such a mistake goes back to Hydra's own report.
    """
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except Exception as err:
        message = None if _USER_FULL_ERROR else _startup_error(err)
        if message is not None:
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)
        _restore_hydra_errors()
        if _USER_FULL_ERROR:
            raise
        from hydra._internal.utils import run_and_report

        failure = err  # (`err` is unbound once this block ends)

        def report():
            raise failure

        run_and_report(report)


def _restore_hydra_errors() -> None:
    if not _USER_FULL_ERROR:
        os.environ.pop("HYDRA_FULL_ERROR", None)


def _startup_error(err: Exception) -> str | None:
    """The message of a user's mistake that stopped Hydra before the task; None otherwise."""
    import yaml

    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, yaml.YAMLError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, yaml.MarkedYAMLError) and cause.problem_mark is not None:
        mark = cause.problem_mark
        return (f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML "
                f"({cause.problem}); fix this config file")
    if cause is not None:
        return f"a config file is not valid YAML: {cause}"
    from hydra.errors import ConfigCompositionException

    text = str(err)
    if isinstance(err, ConfigCompositionException) and text.startswith("Could not override '"):
        return unknown_key_message(text.split("'")[1])
    missing_option = unknown_option_message(text)
    if missing_option is not None:
        return missing_option
    frames = {frame.f_code.co_name for frame, _ in traceback.walk_tb(err.__traceback__)}
    if isinstance(err, OSError) and "run_job" in frames and "train_task" not in frames:
        why = ("a file is in the way" if isinstance(err, (FileExistsError, NotADirectoryError))
               else err.strerror)
        return (f"cannot write the run dir: {err.filename}: {why}; choose another (`name=...` "
                "or `hydra.run.dir=...`), or make it a folder you can write")
    return None


if __name__ == "__main__":
    main()
