"""Which node runs which pipeline stage, for the run log."""

from __future__ import annotations

import os
import socket
from typing import Mapping


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """The name of the node this process runs on: SLURM's for it, else the host name."""
    e = os.environ if environ is None else environ
    return e.get("SLURMD_NODENAME") or socket.gethostname()


def placement(stages_nodes: list[tuple[int, str]]) -> str:
    """Which node runs which stage, from every rank's (stage, node) in rank order, e.g.
    "stage 0: node1 (rank 0); stage 1: node2 (rank 1)" or "stage 0: gpu07 (ranks 0-3)"."""
    by_stage: dict[int, dict[str, list[int]]] = {}
    for rank, (stage, node) in enumerate(stages_nodes):
        by_stage.setdefault(stage, {}).setdefault(node, []).append(rank)

    def ranks(rs: list[int]) -> str:
        if len(rs) == 1:
            return f"rank {rs[0]}"
        if rs == list(range(rs[0], rs[-1] + 1)):
            return f"ranks {rs[0]}-{rs[-1]}"
        return "ranks " + ", ".join(map(str, rs))

    return "; ".join(f"stage {stage}: " + ", ".join(f"{node} ({ranks(rs)})" for node, rs in nodes.items())
                     for stage, nodes in sorted(by_stage.items()))
