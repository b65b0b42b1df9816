"""`dpipe-train [overrides]`: compose the run config, check it, start the workers, train.

    dpipe-train                                   # the tiny demo: 2 stages in 2 CPU processes
    dpipe-train --cfg job model=flux pipeline=four_stage optim.lr=2e-5   # print the config
    dpipe-train -m optim.lr=1e-4,5e-5             # a sweep, one run dir per point
    dpipe-train cluster=slurm_gpu optim.lr=1e-4,5e-5   # the same sweep as a SLURM job array

Started by dpipe itself, by torchrun, or in SLURM tasks (via submitit, see docs/cluster.md): in
the last two cases the ranks come from the environment and no workers are started.
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from dpipe.config.checks import validate
from dpipe.config.store import register_schemas
from dpipe.errors import UserError
from dpipe.launch import env as dist_env
from dpipe.launch.quiet import quiet_libraries
from dpipe.io import atomic_write_text
from dpipe.launch.local import ERRORS_DIR, launch_workers, world_size_for
from dpipe.launch.run_rank import run_rank, save_run_config, train_job
from dpipe.launch.sweep import register_launchers
from dpipe.sample.requests import sample_requests

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
log = logging.getLogger("dpipe")


def train_task(cfg: DictConfig) -> int:
    """Hydra's task function: one run (or one point of a sweep)."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweep_point = hydra_cfg.mode == RunMode.MULTIRUN
    env = dist_env.from_environ()
    if env is not None:  # torchrun or a SLURM task: this process is one of the ranks
        return _run_as_rank(cfg, run_dir, env)
    try:
        run = validate(cfg)
        import torch

        from dpipe.models.registry import build_spec

        from dpipe.train import checkpoint

        world = world_size_for(run, torch.cuda.device_count())
        if run.train.resume:  # an incompatible checkpoint fails before any worker starts
            checkpoint.check_resume(run_dir, run_yaml(run))
        spec = build_spec(run.model)
        spec.ensure_available()  # a bad model path fails before any worker starts
        sample_requests(run.sample, spec, run.dataset)  # so does a bad sample.prompts item
        save_run_config(run, run_dir)
        log.info("run dir: %s; starting %d worker processes", run_dir, world)
        code = launch_workers(run_dir, world)
    except UserError as err:
        if sweep_point:
            raise  # the launcher records it and goes on with the next point
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if code and sweep_point:
        raise RuntimeError(_first_error(run_dir) or f"a worker process exited with code {code}")
    return _exit_on_failure(code)


def _run_as_rank(cfg: DictConfig, run_dir: Path, env: dist_env.DistEnv) -> int:
    """One rank of a run whose processes someone else started (torchrun, srun via submitit).

    Any failure ends this process with a non-zero status, never a return: the other ranks may be
    blocked in a collective, and srun's --kill-on-bad-exit stops them when one rank exits so.
    """
    from dpipe.train import checkpoint, preemption

    dist_env.export(env)
    try:
        run = validate(cfg, world_size=env.world_size)
        if run.train.resume:
            checkpoint.check_resume(run_dir, run_yaml(run))  # the same verdict on every rank
        if env.is_main:
            save_run_config(run, run_dir)
        preemption.install()  # SLURM's time-limit signal -> checkpoint + requeue (submitit only)
        code = run_rank(train_job(run, run_dir), run_dir)
    except UserError as err:
        _record_error(run_dir, env.rank, str(err))
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as err:
        traceback.print_exc()
        _record_error(run_dir, env.rank, f"rank {env.rank} crashed: {type(err).__name__}: {err}")
        sys.exit(1)
    return _exit_on_failure(code)


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
    quiet_libraries()
    register_schemas()
    register_launchers()
    if dist_env.process_rank() != 0:
        # Under torchrun or srun every rank composes the config, but only rank 0 owns the run dir.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(train_task)()


if __name__ == "__main__":
    main()
