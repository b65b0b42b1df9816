"""Against a real SLURM (scripts/slurm: munged, MariaDB, slurmdbd, slurmctld, slurmd on localhost),
started for the session by the `slurm` fixture and stopped by PID at its end.

Sweeps go through `dpipe-train cluster=slurm_cpu ...` as a user types them: a job array, each
point a 2-task job (2 pipeline stages on CPU, gloo). Then an external requeue (SIGTERM: restart
from the last periodic checkpoint) and a cancelled job (reported within seconds). The time-limit
signal (USR2: checkpoint, requeue, resume to the very same weights and losses) is checked by
test_slurm_two_nodes.py's 2 x 1-task job, whose one job takes it before it loses a node: a
second job here would repeat that check at the cost of a job, a requeue and two restarts.

Without SLURM installed these tests skip; with DPIPE_REQUIRE_SLURM=1 (CI) they install it
(scripts/slurm/install.sh, root + apt) and fail if it cannot run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import REPO, metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPTS = REPO / "scripts" / "slurm"
BASE = ["cluster=slurm_cpu", "model=tiny_flux", "dataset=synthetic", "pipeline.stages=2",
        "pipeline.micro_batches=4", "optim.lr=1e-3", "train.checkpoint_every_steps=10",
        "train.progress_bar=false", "hydra.launcher.poll_interval_s=1"]
LORA = "lora/pytorch_lora_weights.safetensors"


@pytest.fixture(scope="session")
def slurm():
    """A private single-node SLURM for this session (never a real cluster's)."""
    required = os.environ.get("DPIPE_REQUIRE_SLURM") == "1"
    if shutil.which("slurmctld") is None:
        if not required:
            pytest.skip("SLURM is not installed: run `bash scripts/slurm/install.sh` (root, apt) "
                        "or set DPIPE_REQUIRE_SLURM=1 to have the tests install it")
        subprocess.run(["bash", str(SCRIPTS / "install.sh")], check=True, timeout=900)
    # Short (job-step sockets live under it) and open to all: munged refuses a socket dir whose
    # path others cannot traverse, as pytest's own temp dirs are (0700).
    root = Path(tempfile.mkdtemp(prefix="dpipe-slurm-", dir="/tmp"))
    root.chmod(0o755)
    start = subprocess.run(["bash", str(SCRIPTS / "start.sh"), str(root)], capture_output=True,
                           text=True, timeout=300)
    if start.returncode:
        pytest.fail(f"could not start the local SLURM:\n{start.stdout}\n{start.stderr}")
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(root / "etc" / "slurm.conf"))
    mp.setenv("DPIPE_SLURM_PARTITION", "debug")
    try:
        yield root
    finally:
        mp.undo()
        subprocess.run(["bash", str(SCRIPTS / "stop.sh"), str(root)], timeout=180,
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Sweep:
    """A `dpipe-train` sweep running in the background in `folder`, its output going to files
    there; its sweep dir `hydra.sweep.dir` if the test pins it, else the one dpipe names."""

    proc: subprocess.Popen
    folder: Path
    started: float
    pinned: Path | None = None

    @property
    def sweep_dir(self) -> Path:
        if self.pinned is not None:
            return self.pinned
        (found,) = (self.folder / "multirun").glob("*/*")  # multirun/<name>/<date>_<time>
        return found

    @property
    def output(self) -> str:
        return "".join((self.folder / f"dpipe-train.{s}").read_text() for s in ("out", "err"))

    def job_ids(self, timeout: float = 120) -> dict[int, str]:
        """{point: SLURM job id}, from the launcher's log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = dict(re.findall(r"#(\d+) -> job (\S+):", self.output))
            if found:
                return {int(k): v for k, v in found.items()}
            assert self.proc.poll() is None, f"dpipe-train ended early:\n{self.output}"
            time.sleep(0.2)
        raise AssertionError(f"no job submitted after {timeout}s:\n{self.output}")

    def run_dir(self, point: int = 0) -> Path:
        return next(self.sweep_dir.glob(f"{point}_*"))

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"dpipe-train did not finish in {timeout}s:\n{self.output}") from None

    def summary(self) -> list[dict]:
        return json.loads((self.sweep_dir / "sweep_summary.json").read_text())["points"]

    def job_log(self, job_id: str, task: int = 0) -> str:
        folder = self.sweep_dir / ".submitit" / job_id
        return "".join(p.read_text(errors="replace") for p in sorted(folder.glob(f"*_{task}_log.*")))


def start_sweep(folder: Path, *overrides: str, pin: bool = True,
                base: tuple[str, ...] = tuple(BASE)) -> Sweep:
    """`dpipe-train base overrides` started in `folder`; `pin`: its sweep dir is `folder`/sweep
    (then a test finds the run dirs before the sweep dir's dated name could be known)."""
    folder.mkdir(parents=True, exist_ok=True)
    pinned = folder / "sweep" if pin else None
    out = (folder / "dpipe-train.out").open("w")
    err = (folder / "dpipe-train.err").open("w")
    pinning = [f"hydra.sweep.dir={pinned}"] if pinned else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpipe.cli.train", *pinning, *base, *overrides],
        cwd=folder, stdout=out, stderr=err, start_new_session=True, env=dict(os.environ))
    return Sweep(proc, folder, time.monotonic(), pinned)


def wait_for(what: str, condition, sweep: Sweep, timeout: float = 300, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while not condition():
        assert sweep.proc.poll() is None, f"dpipe-train ended while waiting for {what}:\n{sweep.output}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{sweep.output}"
        time.sleep(step)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def sacct(job_id: str, fields: str) -> list[list[str]]:
    out = subprocess.run(["sacct", "-n", "-P", "-D", "-j", job_id, "-o", fields],
                         capture_output=True, text=True, check=True).stdout
    return [line.split("|") for line in out.splitlines() if line]


def stamp(text: str) -> float:
    """Seconds since the epoch of a log time stamp like 2026-11-30 04:21:39,207."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / LORA), load_file(b / LORA)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key} differs"


def test_sweep_runs_as_a_job_array_of_two_task_jobs(slurm, tmp_path):
    # docs/cluster.md's SLURM sweep as test_documented_commands maps it (one step per point; that
    # module leaves it to this test): the defaults, no sweep dir given
    from tests.integration.test_documented_commands import documented_command

    documented = documented_command(
        "dpipe-train cluster=slurm_cpu optim.lr=1e-4,5e-5 train.max_steps=1")
    sweep = start_sweep(tmp_path, *documented.args, pin=False, base=())
    assert sweep.wait() == 0, sweep.output
    ids = sweep.job_ids()
    assert len({j.split("_")[0] for j in ids.values()}) == 1, f"not one array: {ids}"
    assert sorted(ids.values()) == [f"{ids[0].split('_')[0]}_{i}" for i in range(2)]
    points = sweep.summary()
    assert [p["status"] for p in points] == ["completed", "completed"]
    assert [p["metrics"]["step"] for p in points] == [1, 1]
    assert "| 0 | optim.lr=0.0001 | completed | 1 |" in sweep.output  # the printed summary
    assert sweep.sweep_dir.parent.name == "tiny_flux-synthetic"
    assert [sweep.run_dir(i).name for i in ids] == ["0_lr=0.0001", "1_lr=5e-05"]
    for point, job in ids.items():
        run_dir = sweep.run_dir(point)
        assert (run_dir / LORA).is_file() and metrics(run_dir)[-1]["step"] == 1
        # one job step of 2 tasks, both ranks of the run (SLURM may still be ending it: the
        # results are in before the processes are gone)
        deadline = time.monotonic() + 60
        while (steps := {row[0]: row[1:] for row in sacct(job, "JobID,State,NTasks")}).get(
                f"{job}.0", [""])[0] != "COMPLETED" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert steps[f"{job}.0"] == ["COMPLETED", "2"], steps
        assert "2 processes = 2 stages x 1 data-parallel" in sweep.job_log(job, 0)
        # Hydra's files in the run dir come from rank 0 (whose job id they record)
        assert re.search(rf"\bid: '?{job}'?\n", (run_dir / ".hydra" / "hydra.yaml").read_text())
    # submit-to-start latency: SLURM's accounting (1 s resolution), and from the launcher's
    # "submitted" line to the first line the job's rank 0 logged (its Python up and running)
    submitted = stamp(re.search(r"\[([\d-]+ [\d:,]+)\]\S* submitted SLURM", sweep.output).group(1))
    for job in ids.values():
        submit, start = sacct(job, "Submit,Start")[0]
        first = re.search(r"\(([\d-]+ [\d:,]+)\) - Starting with", sweep.job_log(job, 0)).group(1)
        print(f"job {job}: SLURM submit {submit}, start {start}; rank 0 running "
              f"{stamp(first) - submitted:.1f} s after submission")


# ~75 s of CI's 2 cores: in `make test-cluster` only (2026-12-07); CI's SLURM requeues are the
# two-node test's (the time-limit signal, then a lost node).
@pytest.mark.cluster_full
def test_external_requeue_restarts_from_the_last_periodic_checkpoint(slurm, tmp_path):
    # time-based checkpoints only: this also shows that train.checkpoint_every_minutes works
    # 150 steps: SLURM takes a second or two to act on a requeue, in which an idle machine
    # trained all of 40 steps (the job then completed before it was requeued).
    steps = 150
    sweep = start_sweep(tmp_path / "requeue", "train.checkpoint_every_steps=0",
                        "train.checkpoint_every_minutes=0.005", f"train.max_steps={steps}")
    job = sweep.job_ids()[0]
    wait_for("a periodic checkpoint",
             lambda: any(sweep.sweep_dir.glob("0_*/checkpoints/step_*/COMPLETE")), sweep)
    subprocess.run(["scontrol", "requeue", job], check=True)  # SIGTERM, no warning
    assert sweep.wait() == 0, sweep.output
    log = sweep.job_log(job)
    resumed = re.search(r"resumed from \S+step_(\d+) \(step (\d+)\)", log)
    assert resumed, log
    assert 1 <= int(resumed.group(2)) < steps
    assert "requeueing the job" not in log  # SLURM's requeue, not dpipe's
    run_dir = sweep.run_dir(0)
    assert metrics(run_dir)[-1]["step"] == steps and (run_dir / LORA).is_file()
    assert [p["status"] for p in sweep.summary()] == ["completed"]


def test_cancelled_job_is_reported_within_seconds(slurm, tmp_path):
    sweep = start_sweep(tmp_path / "cancel", "train.max_steps=100000")
    job = sweep.job_ids()[0]
    wait_for("training to start",
             lambda: any(logged_steps(d) >= 1 for d in sweep.sweep_dir.glob("0_*")), sweep)
    cancelled = time.monotonic()
    subprocess.run(["scancel", job], check=True)
    code = sweep.wait(timeout=60)
    latency = time.monotonic() - cancelled
    print(f"cancel -> dpipe-train exited {code} after {latency:.1f} s")
    assert code != 0
    assert latency < 15, f"took {latency:.1f} s to notice the cancelled job"
    point = sweep.summary()[0]
    assert point["status"] == "cancelled" and "CANCELLED" in point["message"], point
    assert "did not complete" in sweep.output
