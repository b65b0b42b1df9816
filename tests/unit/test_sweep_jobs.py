"""Following sweep jobs: an ended job is reported at once with its reason, a running or requeued
one is waited for (dpipe.launch.jobs, with stand-ins for submitit's jobs)."""

from __future__ import annotations

import pickle
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus

from dpipe.launch import jobs


class Task:
    def __init__(self, folder: Path, task: int):
        self.paths = type("Paths", (), {})()
        self.paths.folder = folder
        self.paths.result_pickle = folder / f"7_1_{task}_result.pkl"
        self.paths.stdout = folder / f"7_1_{task}_log.out"
        self.paths.stderr = folder / f"7_1_{task}_log.err"


class Job:
    job_id = "7_1"

    def __init__(self, folder: Path, state: str = "RUNNING"):
        folder.mkdir(parents=True, exist_ok=True)
        self.state = state
        self._sub_jobs = [Task(folder, 0), Task(folder, 1)]

    def finish(self, rank0_result) -> None:
        for task, result in zip(self._sub_jobs, [rank0_result, ("success", None)]):
            task.paths.result_pickle.write_bytes(pickle.dumps(result))


def tracked(tmp_path, state="RUNNING") -> jobs.Tracked:
    return jobs.Tracked(1, Job(tmp_path / "submitit", state), tmp_path / "run")


def test_running_and_requeued_jobs_are_waited_for(tmp_path):
    t = tracked(tmp_path)
    for state in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "PREEMPTED", "NODE_FAIL"):
        t.job.state = state
        assert not jobs.check(t), state


def test_completed_job(tmp_path):
    t = tracked(tmp_path)
    ret = JobReturn(status=JobStatus.COMPLETED)
    ret.return_value = 0
    t.job.finish(("success", ret))
    assert jobs.check(t) and t.status == "completed" and t.job_return.status == JobStatus.COMPLETED


def test_cancelled_job_is_reported_at_once(tmp_path):
    t = tracked(tmp_path, "CANCELLED by 0")
    assert jobs.check(t)
    assert t.status == "cancelled" and "CANCELLED by 0" in t.message


def test_failed_job_names_the_user_error_a_rank_recorded(tmp_path):
    t = tracked(tmp_path, "FAILED")
    (t.run_dir / ".errors").mkdir(parents=True)
    (t.run_dir / ".errors" / "rank00001.txt").write_text("dataset.path=/x does not exist")
    assert jobs.check(t)
    assert t.status == "failed" and "dataset.path=/x does not exist" in t.message


def test_failed_job_without_a_recorded_error_shows_its_log(tmp_path):
    t = tracked(tmp_path, "OUT_OF_MEMORY")
    t.job._sub_jobs[1].paths.stderr.write_text("Traceback (most recent call last):\nKilled\n")
    assert jobs.check(t)
    assert t.status == "failed" and "OUT_OF_MEMORY" in t.message and "Killed" in t.message


def test_a_failed_point_inside_a_completed_job(tmp_path):
    t = tracked(tmp_path, "COMPLETED")
    ret = JobReturn(status=JobStatus.FAILED)
    ret.return_value = ValueError("bad value")
    t.job.finish(("success", ret))
    assert jobs.check(t) and t.status == "failed" and "bad value" in t.message


def test_a_lost_node_is_waited_on_for_the_requeue_then_reported(tmp_path):
    t = tracked(tmp_path, "NODE_FAIL")
    assert not jobs.check(t)  # SLURM requeues it once the node is DOWN
    t.preempted_at -= jobs.NODE_FAIL_GRACE_S + 1  # ... but this one was never requeued
    assert jobs.check(t)
    assert t.status == "node failed" and "SLURM state NODE_FAIL" in t.message, t.message
