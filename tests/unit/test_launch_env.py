"""Ranks from the environment: SLURM tasks across nodes (a fake two-node job), torchrun, none."""

from __future__ import annotations

import pytest

from dpipe.launch.env import (
    cuda_device, expand_nodelist, from_environ, in_slurm_step, reachable_master,
    slurm_env, tasks_on_node,
)
from dpipe.train.placement import placement


def two_node_task(procid: int, **extra) -> dict:
    """What srun gives task `procid` of a 2-node x 4-task job step (submitit's sbatch script)."""
    env = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
        "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
        "SLURM_NODEID": str(procid // 4), "SLURM_LOCALID": str(procid % 4),
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }
    env.update(extra)
    return env


def test_two_nodes_rank_arithmetic():
    envs = [slurm_env(two_node_task(r)) for r in range(8)]
    assert [e.rank for e in envs] == list(range(8))
    assert {e.world_size for e in envs} == {8}
    assert [e.local_rank for e in envs] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [e.node_rank for e in envs] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {e.local_world_size for e in envs} == {4} and {e.num_nodes for e in envs} == {2}
    # every task meets at the first node, on one port derived from its own job id
    assert {e.master_addr for e in envs} == {"gpu07"}
    assert len({e.master_port for e in envs}) == 1
    assert 15000 <= envs[0].master_port < 30000
    # each task sees the node's 4 GPUs and takes its local rank's
    assert [e.device for e in envs] == [0, 1, 2, 3, 0, 1, 2, 3]
    # 2 pipeline stages x 4 data-parallel replicas: DeepSpeed puts stage s of replica d at rank
    # s*4 + d, so stage 0 runs on gpu07 and stage 1 on gpu08
    stages, dp = 2, 4
    for stage in range(stages):
        assert {envs[stage * dp + d].node_rank for d in range(dp)} == {stage}


def test_array_jobs_get_different_ports():
    a = slurm_env(two_node_task(0, SLURM_JOB_ID="4242"))
    b = slurm_env(two_node_task(0, SLURM_JOB_ID="4243"))
    assert a.master_port != b.master_port
    # an inherited MASTER_PORT (the submitting shell's) is ignored; DPIPE_MASTER_PORT is not
    assert slurm_env(two_node_task(0, MASTER_PORT="29500")).master_port == a.master_port
    assert slurm_env(two_node_task(0, DPIPE_MASTER_PORT="31111")).master_port == 31111


def test_one_gpu_per_task_uses_device_zero():
    env = slurm_env(two_node_task(5, CUDA_VISIBLE_DEVICES="6"))
    assert env.local_rank == 1 and env.device == 0
    assert cuda_device(None, 3, 4) == 3 and cuda_device("", 3, 4) == 3
    assert cuda_device("GPU-aa,GPU-bb", 1, 2) == 1 and cuda_device("0", 0, 1) == 0


def test_batch_script_is_not_a_rank():
    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "vm", "SLURM_TASKS_PER_NODE": "2"}
    assert not in_slurm_step(batch) and from_environ(batch) is None
    step = dict(batch, SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1",
                SLURM_LOCALID="1")
    assert in_slurm_step(step) and from_environ(step).rank == 1
    # a single-task srun step: dpipe starts the workers itself
    assert from_environ(dict(step, SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0")) is None
    # torchrun inside srun sets RANK and wins
    torchrun = dict(step, RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", MASTER_ADDR="h", MASTER_PORT="1")
    env = from_environ(torchrun)
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (3, 4, "h", 1)


def test_submitit_task_wins_over_inherited_rank_variables():
    env = from_environ(two_node_task(6, RANK="0", WORLD_SIZE="1"))
    assert (env.rank, env.world_size) == (6, 8)


def test_slurm_lists():
    assert expand_nodelist("gpu[01-03,7],login1") == ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]
    assert expand_nodelist("vm") == ["vm"]
    assert expand_nodelist("a[9-11]-ib") == ["a9-ib", "a10-ib", "a11-ib"]
    assert [tasks_on_node("4(x2),2", n) for n in range(3)] == [4, 4, 2]
    with pytest.raises(ValueError):
        tasks_on_node("four", 0)


def test_master_name_that_does_not_resolve_becomes_its_node_addr():
    task = two_node_task(5)
    env = slurm_env(task)
    asked = []

    def node_addr(node):
        asked.append(node)
        return "10.213.0.7"

    # a name the resolver knows is used as it is; SLURM is not asked
    assert reachable_master(env, task, resolve=lambda h: True, node_addr=node_addr) == env
    assert asked == []
    # one it does not know: slurm.conf's NodeAddr for that node
    fixed = reachable_master(env, task, resolve=lambda h: False, node_addr=node_addr)
    assert asked == ["gpu07"] and fixed.master_addr == "10.213.0.7"
    assert fixed.rank == env.rank and fixed.master_port == env.master_port
    # NodeAddr unknown (or the same name): left alone, torch then names the host it failed on
    assert reachable_master(env, task, resolve=lambda h: False, node_addr=lambda n: None) == env
    # DPIPE_MASTER_ADDR wins and is never second-guessed
    task = two_node_task(5, DPIPE_MASTER_ADDR="10.9.9.9")
    env = slurm_env(task)
    assert env.master_addr == "10.9.9.9"
    assert reachable_master(env, task, resolve=lambda h: False, node_addr=node_addr) == env


def test_placement_names_the_node_of_each_stage():
    assert placement([(0, "node1"), (1, "node2")]) == "stage 0: node1 (rank 0); stage 1: node2 (rank 1)"
    # 2 stages x 2 replicas, pipe-major ranks
    assert (placement([(0, "node1"), (0, "node1"), (1, "node2"), (1, "node2")])
            == "stage 0: node1 (ranks 0-1); stage 1: node2 (ranks 2-3)")
    assert placement([(0, "a"), (0, "b"), (1, "a")]) == "stage 0: a (rank 0), b (rank 1); stage 1: a (rank 2)"
