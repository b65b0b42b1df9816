"""Where the ranks meet. dpipe's launcher hosts its workers' rendezvous store
(dpipe.launch.local.hosted_store): the port is held from the moment it is chosen, so no other
process can take it before the workers start. Where rank 0 opens the store itself (SLURM, torchrun)
on a port another process holds, the error names the setting to change."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from dpipe.launch.local import WORKERS_USE_HOSTED_STORE, hosted_store


def test_the_port_is_held_from_the_start():
    with hosted_store() as port:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE


def _rank(rank: int, port: int, world: int) -> None:
    import torch.distributed as dist

    os.environ.update(WORKERS_USE_HOSTED_STORE, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo")  # env://, as DeepSpeed's init_distributed does
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2
    dist.destroy_process_group()


@pytest.mark.slow
def test_workers_rendezvous_through_the_hosted_store():
    with hosted_store() as port:
        # Every rank a client: were rank 0 to host a store too, it would fail on the held port.
        mp.spawn(_rank, args=(port, 2), nprocs=2, join=True)


@pytest.mark.slow
def test_a_taken_rendezvous_port_is_a_clear_error():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
        code = ("from dpipe.errors import ConfigError\n"
                "from dpipe.pipeline.engine import init_distributed\n"
                "try:\n    init_distributed('gloo')\n"
                "except ConfigError as e:\n    print(e)\n")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"rendezvous port {port}" in proc.stdout and "DPIPE_MASTER_PORT" in proc.stdout, (
        proc.stdout + proc.stderr[-3000:])
