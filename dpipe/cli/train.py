"""`dpipe-train [overrides]`: compose the run config, check it, start the workers, train.

    dpipe-train                                   # the tiny demo: 2 stages in 2 CPU processes
    dpipe-train --cfg job model=flux pipeline=four_stage optim.lr=2e-5   # print the config
    dpipe-train -m optim.lr=1e-4,5e-5             # a sweep, one run dir per point

Started by dpipe itself, by torchrun, or in SLURM tasks (via submitit): in the last two cases the
ranks come from the environment and no workers are started.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dpipe.config.checks import validate
from dpipe.config.store import register_schemas
from dpipe.errors import UserError
from dpipe.launch import env as dist_env
from dpipe.launch.quiet import quiet_libraries
from dpipe.launch.local import launch_workers, world_size_for
from dpipe.launch.run_rank import run_rank, save_run_config

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
log = logging.getLogger("dpipe")


def train_task(cfg: DictConfig) -> int:
    """Hydra's task function: one run (or one point of a sweep)."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    env = dist_env.from_environ()
    try:
        run = validate(cfg, world_size=env.world_size if env else None)
        if env is not None:  # torchrun or a SLURM task: this process is one of the ranks
            dist_env.export(env)
            if env.is_main:
                save_run_config(run, run_dir)
            return _exit_on_failure(run_rank(run, run_dir))
        import torch

        from dpipe.models.registry import build_spec

        world = world_size_for(run, torch.cuda.device_count())
        build_spec(run.model).ensure_available()  # a bad model path fails before any worker starts
        save_run_config(run, run_dir)
        log.info("run dir: %s; starting %d worker processes", run_dir, world)
        return _exit_on_failure(launch_workers(run_dir, world))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _exit_on_failure(code: int) -> int:
    if code:
        sys.exit(code)
    return code


def main() -> None:
    quiet_libraries()
    register_schemas()
    if os.environ.get("RANK", "0") != "0":
        # Under torchrun every rank composes the config, but only rank 0 owns the run dir.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(train_task)()


if __name__ == "__main__":
    main()
