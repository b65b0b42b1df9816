"""Where this process sits in the job: its rank, the world size and the rendezvous address.

Three cases, in order:
1. A task of a SLURM job step started by submitit (`SUBMITIT_EXECUTOR=slurm`) or by a plain
   `srun` with several tasks: one process per GPU, ranks from SLURM's variables. The batch script
   itself also has SLURM_PROCID=0 and SLURM_NTASKS, but it is no job step: it is not a rank.
2. Variables set by dpipe's own local launcher or by torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
   MASTER_ADDR, MASTER_PORT).
3. Else None: a single process that still has to start the workers itself.

`slurm_env` is a pure function of the environment so that tests can feed it a fake two-node job.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from dataclasses import dataclass, replace
from typing import Callable, Mapping

# Rendezvous ports derived from the job id, below Linux's ephemeral range (32768-60999) so that
# no outgoing connection holds them; consecutive job ids on one node get different ports.
PORT_BASE, PORT_SPAN = 15000, 15000


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world_size: int = 0  # 0: all ranks on this machine (world_size)
    node_rank: int = 0
    num_nodes: int = 1
    # The CUDA device index this rank uses among the GPUs it can see: its local rank when every
    # task of a node sees all of the node's GPUs, 0 when SLURM binds each task to its own GPU.
    device: int | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def in_slurm_step(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one task of a multi-task SLURM job step (so one rank of a run)."""
    e = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in e or "SLURM_PROCID" not in e:
        return False
    if e.get("SUBMITIT_EXECUTOR") == "slurm":
        return True
    # A plain `srun -n N dpipe-train ...`: only a job step (not the batch script) has SLURM_STEP_ID.
    # A torchrun started by srun sets RANK itself and wins.
    return "SLURM_STEP_ID" in e and int(e.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "RANK" not in e


def from_environ(environ: Mapping[str, str] | None = None) -> DistEnv | None:
    """The distributed environment this process was started in, or None if there is none."""
    e = os.environ if environ is None else environ
    if in_slurm_step(e):
        return slurm_env(e)
    if "RANK" in e and "WORLD_SIZE" in e:
        world = int(e["WORLD_SIZE"])
        return DistEnv(
            rank=int(e["RANK"]),
            world_size=world,
            local_rank=int(e.get("LOCAL_RANK", "0")),
            master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(e.get("MASTER_PORT", "29500")),
            local_world_size=int(e.get("LOCAL_WORLD_SIZE", world)),
        )
    return None


def process_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank, 0 outside any distributed environment (cheap: no export)."""
    env = from_environ(environ)
    return env.rank if env is not None else 0


def slurm_env(environ: Mapping[str, str]) -> DistEnv:
    """Ranks of a SLURM task: one process per GPU, `nodes x tasks_per_node` of them.

    Global rank = SLURM_PROCID (SLURM numbers the tasks node by node), the master is the first
    node of the step (where rank 0 runs; `reachable_master` turns its name into an address if it
    does not resolve), the port comes from the job id, so every task of the job computes the same
    one and concurrent jobs on a node do not collide. DPIPE_MASTER_PORT overrides the port and
    DPIPE_MASTER_ADDR the address (MASTER_PORT/MASTER_ADDR are not used: sbatch copies the
    submitting shell's environment into every job of an array, so one inherited value would
    collide).
    """
    e = environ
    world = int(e.get("SLURM_STEP_NUM_TASKS") or e["SLURM_NTASKS"])
    nodes = int(e.get("SLURM_STEP_NUM_NODES") or e.get("SLURM_JOB_NUM_NODES") or e.get("SLURM_NNODES") or 1)
    node_rank = int(e.get("SLURM_NODEID", "0"))
    local_rank = int(e.get("SLURM_LOCALID", "0"))
    per_node = e.get("SLURM_STEP_TASKS_PER_NODE") or e.get("SLURM_TASKS_PER_NODE")
    local_world = tasks_on_node(per_node, node_rank) if per_node else world // nodes
    hosts = expand_nodelist(e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST") or "")
    if "DPIPE_MASTER_PORT" in e:
        port = int(e["DPIPE_MASTER_PORT"])
    else:
        port = PORT_BASE + int(e["SLURM_JOB_ID"]) % PORT_SPAN
    return DistEnv(
        rank=int(e["SLURM_PROCID"]),
        world_size=world,
        local_rank=local_rank,
        master_addr=e.get("DPIPE_MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
        master_port=port,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=nodes,
        device=cuda_device(e.get("CUDA_VISIBLE_DEVICES"), local_rank, local_world),
    )


def resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def slurm_node_addr(node: str) -> str | None:
    """The NodeAddr that slurm.conf gives `node` (SLURM's own address for it), or None."""
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bNodeAddr=(\S+)", out)
    return m.group(1) if m else None


def reachable_master(env: DistEnv, environ: Mapping[str, str] | None = None,
                     resolve: Callable[[str], bool] = resolves,
                     node_addr: Callable[[str], str | None] = slurm_node_addr) -> DistEnv:
    """`env` with a master address the ranks can connect to.

    SLURM names the first node of the step; where that name does not resolve (slurm.conf gives
    the node a NodeAddr of its own, as clusters do whose nodes are reached by address or on a
    network of their own), the node's NodeAddr from `scontrol show node` is used. An address
    given in DPIPE_MASTER_ADDR is used as it is.
    """
    e = os.environ if environ is None else environ
    if "DPIPE_MASTER_ADDR" in e or "SLURM_JOB_ID" not in e or resolve(env.master_addr):
        return env
    addr = node_addr(env.master_addr)
    if not addr or addr == env.master_addr:
        return env
    return replace(env, master_addr=addr)


def cuda_device(visible: str | None, local_rank: int, local_world: int) -> int:
    """Which visible GPU a task uses: each task of a node either sees all the node's GPUs (SLURM's
    default with --gpus-per-node: pick the local rank's) or only its own (--gpus-per-task=1 or
    --gpu-bind: device 0)."""
    if visible is None or visible.strip() in ("", "NoDevFiles"):
        return local_rank
    count = len([d for d in visible.split(",") if d.strip()])
    if count == 1 and local_world > 1:
        return 0
    return local_rank


def tasks_on_node(spec: str, node: int) -> int:
    """Tasks on node `node` from SLURM's compressed list, e.g. "4(x2),2" -> 4, 4, 2."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"cannot read the SLURM task list {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[min(node, len(counts) - 1)]


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, e.g. "gpu[01-03,7],login1" -> gpu01 gpu02 gpu03 gpu7 login1."""
    hosts: list[str] = []
    for group in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", group)
        if m is None:
            hosts.append(group)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    return hosts


def export(env: DistEnv) -> None:
    """Sets the variables torch.distributed and DeepSpeed read.

    LOCAL_RANK is the CUDA device index to use (what torch and DeepSpeed do with it); it equals
    the task's local rank unless SLURM gave each task a single GPU of its own.
    """
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank if env.device is None else env.device),
        LOCAL_WORLD_SIZE=str(env.local_world_size or env.world_size),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
        DPIPE_NODE_RANK=str(env.node_rank),
        DPIPE_NUM_NODES=str(env.num_nodes),
    )
