"""A pipeline split across two SLURM nodes: scripts/slurm/start.sh with DPIPE_SLURM_NETNS_NODES=2
makes node1 and node2, each a network namespace of its own (own address on a private /24, own
hostname, own slurmd), one slurmctld, munge and accounting shared, the filesystem shared.

The ranks meet over the nodes' addresses only: the preset's socket_ifname (here from the
environment's DPIPE_SOCKET_IFNAME) names their interface, and the master's node name, which
resolves nowhere, becomes its NodeAddr. Checked: a job array of two 2 stages x 2 replicas points
over both nodes completes, the one with the reference's settings with the same losses and LoRA,
bit for bit, as on one node; a 2 nodes x 1 task run (stage 0 on node1, stage 1 on node2) takes
the time-limit signal (USR2: checkpoint, requeue, resume), then loses node2 as a crash would and,
requeued once the node is back, resumes from its newest complete checkpoint and ends equal, bit
for bit, to the same run made straight on one node.

The job array check (four 4-rank runs) is marked `cluster_full`: `make test-cluster` runs it,
`make test` (CI) does not, for time; the lost-node check runs in both.

Needs root, iproute2 and SLURM: skips without them, fails instead with DPIPE_REQUIRE_SLURM=1 (CI).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.cli import metrics
from tests.integration.test_slurm import (
    SCRIPTS, Sweep, logged_steps, sacct, same_weights, start_sweep, wait_for,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 60  # room to signal, checkpoint and crash a node mid-run; each step ~0.1 s
TWO_NODES = [f"train.max_steps={STEPS}", "hydra.launcher.nodes=2"]
IFNAME = "dpnet0"  # each node's interface (scripts/slurm/start.sh)


def _missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "not root: network namespaces for the nodes need root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2 / util-linux (scripts/slurm/install.sh)"
    if shutil.which("slurmctld") is None:
        return "SLURM is not installed: run `bash scripts/slurm/install.sh` (root, apt)"
    return None


@pytest.fixture(scope="module")
def two_nodes():
    """A private two-node SLURM for this module, removed at its end (daemons, namespaces, links)."""
    missing = _missing_tools()
    if missing and os.environ.get("DPIPE_REQUIRE_SLURM") == "1" and os.geteuid() == 0:
        subprocess.run(["bash", str(SCRIPTS / "install.sh")], check=True, timeout=900)
        missing = _missing_tools()
    if missing:
        if os.environ.get("DPIPE_REQUIRE_SLURM") == "1":
            pytest.fail(f"two-node SLURM required (DPIPE_REQUIRE_SLURM=1) but: {missing}")
        pytest.skip(missing)
    root = Path(tempfile.mkdtemp(prefix="dpipe-2n-", dir="/tmp"))
    root.chmod(0o755)
    env = dict(os.environ, DPIPE_SLURM_NETNS_NODES="2", DPIPE_SLURMD_TIMEOUT="6")
    start = subprocess.run(["bash", str(SCRIPTS / "start.sh"), str(root)], capture_output=True,
                           text=True, timeout=300, env=env)
    if start.returncode:
        subprocess.run(["bash", str(SCRIPTS / "stop.sh"), str(root)], timeout=180, capture_output=True)
        pytest.fail(f"could not start the two-node SLURM:\n{start.stdout}\n{start.stderr}")
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(root / "etc" / "slurm.conf"))
    mp.setenv("DPIPE_SLURM_PARTITION", "debug")
    mp.setenv("DPIPE_SOCKET_IFNAME", IFNAME)  # read by the preset (hydra.launcher.socket_ifname)
    try:
        yield root
    finally:
        mp.undo()
        stop = subprocess.run(["bash", str(SCRIPTS / "stop.sh"), str(root)], timeout=180,
                              capture_output=True, text=True)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        shutil.rmtree(root, ignore_errors=True)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        port = re.search(r"removed bridge dpbr(\d+)", stop.stdout)
        assert port and f"dpipe{port.group(1)}n" not in left, stop.stdout + left


def _losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir)}


def _node_list(job: str) -> str:
    return sacct(job, "JobID,NodeList")[0][1]


@pytest.fixture(scope="module")
def straight(two_nodes, tmp_path_factory) -> Sweep:
    """On one node: 2 stages x 1 replica, uninterrupted (the lost-node run's reference)."""
    sweep = start_sweep(tmp_path_factory.mktemp("straight"), f"train.max_steps={STEPS}",
                        "hydra.launcher.nodes=1")
    assert sweep.wait() == 0, sweep.output
    return sweep


@pytest.fixture(scope="module")
def arrays(two_nodes, tmp_path_factory) -> tuple[Sweep, Sweep]:
    """On one node: 2 stages x 2 replicas (the reference). On two nodes: one job array of two
    2 x 2 points (lr 1e-3, the reference's, and 5e-4)."""
    base = tmp_path_factory.mktemp("arrays")
    timings = {}
    sweeps = []
    for nodes, points in ((1, "pipeline.data_parallel=2"),
                          (2, "pipeline.data_parallel=2 optim.lr=1e-3,5e-4")):
        t = time.monotonic()
        sweep = start_sweep(base / f"nodes{nodes}", f"train.max_steps={STEPS}",
                            f"hydra.launcher.nodes={nodes}", *points.split())
        assert sweep.wait() == 0, sweep.output
        timings[nodes] = time.monotonic() - t
        sweeps.append(sweep)
    print(f"the reference on 1 node: {timings[1]:.1f} s; job array of 2 points on 2 nodes: "
          f"{timings[2]:.1f} s")
    return sweeps[0], sweeps[1]


# Four 4-rank runs (~150 s of CI's 2 cores): in `make test-cluster`, not in `make test`; the
# lost-node test below, in both, runs its stages on both nodes too.
@pytest.mark.cluster_full
def test_two_node_job_array_equals_one_node(arrays):
    one, two = arrays
    ids = two.job_ids()
    array = ids[0].split("_")[0]
    assert sorted(ids.values()) == [f"{array}_0", f"{array}_1"], f"not one job array: {ids}"
    points = two.summary()
    assert [p["status"] for p in points] == ["completed", "completed"]
    assert [p["metrics"]["step"] for p in points] == [STEPS, STEPS]
    assert re.search(r"\| 1 \| .*optim.lr=0.0005.* \| completed \| 60 \|", two.output), two.output
    for job in ids.values():
        assert _node_list(job) == "node[1-2]", sacct(job, "JobID,NodeList")
        log = two.job_log(job)
        assert "stages on nodes: stage 0: node1 (ranks 0-1); stage 1: node2 (ranks 2-3)" in log, log
        tasks = {row[0]: row[1] for row in sacct(job, "JobID,NTasks")}
        assert tasks.get(f"{job}.0") == "4", tasks  # every rank of the step: 2 per node
    # the reference (2 x 2, lr 1e-3) ran all its ranks on one node
    ref_job = one.job_ids()[0]
    assert re.fullmatch(r"node[12]", _node_list(ref_job)), sacct(ref_job, "JobID,NodeList")
    assert re.search(r"stages on nodes: stage 0: (node[12]) \(ranks 0-1\); stage 1: \1 ",
                     one.job_log(ref_job)), one.job_log(ref_job)
    # the same losses at every step and the same LoRA, bit for bit (fp32, gloo)
    run, ref = two.run_dir(0), one.run_dir(0)
    assert metrics(run)[-1]["step"] == STEPS
    assert _losses(run) == _losses(ref)
    same_weights(run, ref)


def _job_state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                          text=True).stdout.strip()


def test_time_limit_signal_then_a_lost_node_resume_to_the_straight_run(straight, two_nodes,
                                                                      tmp_path):
    # 2 nodes x 1 task (stage 0 on node1, stage 1 on node2) ends equal to the same run on one
    # node, uninterrupted
    reference = straight.run_dir(0)
    sweep = start_sweep(tmp_path / "lost", *TWO_NODES)
    job = sweep.job_ids()[0]
    run_dir = None

    def training():
        nonlocal run_dir
        run_dir = next(sweep.sweep_dir.glob("0_*"), None)
        return run_dir is not None and logged_steps(run_dir) >= 3

    # 1. the time-limit signal: both ranks checkpoint the same step, the job requeues, resumes
    wait_for("training to start", training, sweep)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    wait_for("the resume after USR2", lambda: "resumed from" in sweep.job_log(job), sweep)
    log = sweep.job_log(job)
    saved = int(re.search(r"checkpoint of step (\d+) complete: requeueing the job", log).group(1))
    assert 3 <= saved < STEPS
    assert re.search(rf"resumed from \S+step_{saved:08d} \(step {saved}\)", log), log
    assert "REQUEUED" in [row[1] for row in sacct(job, "JobID,State")], sacct(job, "JobID,State")
    layers = sorted(p.name for p in (run_dir / "checkpoints" / f"step_{saved:08d}").glob("layer_*"))
    assert layers, "no per-layer files"  # written by both stages: their layers together
    assert "stages on nodes: stage 0: node1 (rank 0); stage 1: node2 (rank 1)" in log

    # 2. node2 dies (link down, slurmd and the job's processes killed) after a newer checkpoint
    def newer_checkpoint():
        return any(int(p.parent.name[5:]) > saved
                   for p in (run_dir / "checkpoints").glob("step_*/COMPLETE"))

    wait_for("a checkpoint after the resume", newer_checkpoint, sweep, step=0.02)
    crash = subprocess.run(["bash", str(SCRIPTS / "node.sh"), str(two_nodes), "node2", "crash"],
                           capture_output=True, text=True, check=True)
    crashed_at, crashed_step = time.time(), logged_steps(run_dir)
    assert crashed_step < STEPS, "the run ended before node2 could be lost: give it more steps"
    newest = max(int(p.parent.name[5:]) for p in (run_dir / "checkpoints").glob("step_*/COMPLETE"))
    print(crash.stdout.strip(), f"at step {crashed_step}, newest checkpoint step {newest}")
    # SLURM finds node2 silent, fails the job's attempt (NODE_FAIL) and requeues it
    wait_for("the job requeued", lambda: _job_state(job) == "PENDING", sweep, timeout=300, step=0.5)
    down_at = time.time()
    # what a crash in the middle of writing leaves: a newer step folder without COMPLETE
    partial = run_dir / "checkpoints" / f"step_{newest + 1:08d}"
    shutil.copytree(run_dir / "checkpoints" / f"step_{newest:08d}", partial)
    (partial / "COMPLETE").unlink()
    next(partial.glob("layer_*")).write_bytes(b"half")
    lock_left = (run_dir / ".lock").exists()
    subprocess.run(["bash", str(SCRIPTS / "node.sh"), str(two_nodes), "node2", "start"], check=True)
    assert sweep.wait() == 0, sweep.output
    log = sweep.job_log(job)
    resumes = re.findall(r"\[(\d\d:\d\d:\d\d) \S+\] resumed from \S+step_(\d+) \(step (\d+)\)", log)
    assert len(resumes) >= 2, log
    assert int(resumes[-1][2]) == newest, (resumes, newest)  # not the half-written newest + 1
    if lock_left:
        assert "took over the lock" in log, log
    states = [row[1] for row in sacct(job, "JobID,State")]
    assert "NODE_FAIL" in states and "REQUEUED" in states, states
    # ends as if nothing happened
    assert metrics(run_dir)[-1]["step"] == STEPS
    assert _losses(run_dir) == _losses(reference)
    same_weights(run_dir, reference)
    assert [p["status"] for p in sweep.summary()] == ["completed"]
    resumed_at = datetime.combine(datetime.now().date(),
                                  datetime.strptime(resumes[-1][0], "%H:%M:%S").time()).timestamp()
    print(f"node loss: crash at step {crashed_step}, resumed at step {newest}: "
          f"{crashed_step - newest} steps redone; job requeued {down_at - crashed_at:.1f} s after "
          f"the crash, training again {resumed_at - crashed_at:.1f} s after it; lock left: {lock_left}")
