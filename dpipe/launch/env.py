"""Where this process sits in the job: its rank, the world size and the rendezvous address.

Three sources, in order: variables set by dpipe's own local launcher or torchrun (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a SLURM task (through submitit, which derives
the same from SLURM's variables); else a single process that still has to start the workers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_environ() -> DistEnv | None:
    """The distributed environment this process was started in, or None if there is none."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return DistEnv(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", "29500")),
        )
    if "SLURM_JOB_ID" in os.environ and "SLURM_NTASKS" in os.environ and "SLURM_PROCID" in os.environ:
        import submitit

        dist_env = submitit.helpers.TorchDistributedEnvironment()
        # One task per GPU: each task sees only its own GPU, so it uses device 0.
        dist_env.export(set_cuda_visible_devices=True, overwrite=True)
        return from_environ()
    return None


def export(env: DistEnv) -> None:
    """Sets the variables torch.distributed and DeepSpeed read."""
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )
