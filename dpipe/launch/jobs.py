"""Following submitit jobs to their end: a finished, failed or cancelled job is noticed within one
poll, never waited on forever.

submitit's own `job.results()` polls SLURM with a back-off of up to 10 minutes and, for a job
that died without a result, waits 15 s more for a result file before it raises. Here every poll
asks SLURM (one `sacct` call for all jobs) and a job that ended without a result is reported at
once, with the reason: SLURM's state, the user error a rank recorded, or the end of the log of
the task that failed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("dpipe")

# SLURM states of a job that may still run (or run again after a requeue).
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
          "SUSPENDED", "COMPLETING", "CONFIGURING", "PREEMPTED", "SIGNALING", "STAGE_OUT",
          "UNKNOWN", "READY", ""}
# How long a job may look ended without its result before it counts as failed (shared
# filesystems show new files late).
RESULT_GRACE_S = 3.0
# A preempted job is normally requeued at once (PreemptMode=REQUEUE); one still PREEMPTED after
# this long was not (PreemptMode=CANCEL) and will not run again.
PREEMPTED_GRACE_S = 300.0
# A job that lost a node (NODE_FAIL) is requeued by SLURM as soon as the node is marked DOWN
# (dpipe submits with --requeue; it resumes from its newest complete checkpoint); one still
# NODE_FAIL after this long was not requeued (JobRequeue=0 at the site, --no-requeue).
NODE_FAIL_GRACE_S = 60.0
# States that may still turn into a requeue, and how long to wait for it.
REQUEUE_GRACE_S = {"PREEMPTED": PREEMPTED_GRACE_S, "NODE_FAIL": NODE_FAIL_GRACE_S}
ERRORS_DIR = ".errors"


@dataclass
class Tracked:
    num: int  # the sweep point
    job: Any  # a submitit Job
    run_dir: Path
    state: str = ""
    ended_at: float | None = None  # when SLURM first said it ended without all results
    preempted_at: float | None = None  # since when SLURM says PREEMPTED or NODE_FAIL
    status: str = ""  # set when done: completed | failed | cancelled | timed out
    message: str = ""
    job_return: Any = None  # hydra's JobReturn of rank 0


def base_state(state: str) -> str:
    """"CANCELLED by 0" -> "CANCELLED"."""
    return (state or "").split()[0].upper() if state else ""


def _is_slurm(job) -> bool:
    from submitit import SlurmJob

    return isinstance(job, SlurmJob)


def job_state(job) -> str:
    """The job's state from the cache of submitit's watcher (refresh it first) or its process."""
    if _is_slurm(job):
        return job.watcher.get_state(job.job_id, mode="cache")
    return job.state  # a local job: RUNNING, FINISHED or INTERRUPTED


def refresh(jobs: list) -> None:
    """One `sacct` call for every registered SLURM job (local jobs need none)."""
    slurm = [job for job in jobs if _is_slurm(job)]
    if slurm:
        watcher = slurm[0].watcher
        # submitit stops asking about a job once it looks finished; a requeued job runs again
        watcher._finished -= {job.job_id for job in slurm}
        watcher.update()


def _result_paths(job) -> list[Path]:
    tasks = getattr(job, "_sub_jobs", None) or [job]
    return [t.paths.result_pickle for t in tasks]


def _load(path: Path):
    from submitit.core.utils import pickle_load

    return pickle_load(path)


def check(t: Tracked) -> bool:
    """Updates `t` from its job's state and result files; True once the job is over."""
    state = job_state(t.job)
    if state != t.state:
        if base_state(state) not in ("", "UNKNOWN"):  # UNKNOWN: not in SLURM's accounting yet
            log.info("sweep point #%d (job %s): %s", t.num, t.job.job_id, state)
        t.state = state
    paths = _result_paths(t.job)
    have = [p.exists() for p in paths]
    ended = base_state(state) not in ACTIVE
    grace = REQUEUE_GRACE_S.get(base_state(state))
    if grace is not None:
        t.preempted_at = t.preempted_at or time.monotonic()
        ended = time.monotonic() - t.preempted_at > grace
    else:
        t.preempted_at = None
    if not all(have) and not ended:
        return False
    if not have[0]:
        # Ended without rank 0's result: failed, cancelled, or killed. Give the filesystem a moment.
        t.ended_at = t.ended_at or time.monotonic()
        if time.monotonic() - t.ended_at < RESULT_GRACE_S and base_state(state) == "COMPLETED":
            return False
        _no_result(t, state)
        return True
    outcome, value = _load(paths[0])
    if outcome == "success" and getattr(value, "status", None) is not None:
        t.job_return = value
        if value.status.name == "COMPLETED":
            t.status = "completed"
        else:
            t.status, t.message = "failed", _first_error(t.run_dir) or str(value._return_value)
    elif outcome == "success":
        t.status = "completed"
    else:  # a traceback string from submitit
        t.status = "failed"
        t.message = _first_error(t.run_dir) or _last_line(str(value))
    return True


def _no_result(t: Tracked, state: str) -> None:
    base = base_state(state)
    t.status = {"CANCELLED": "cancelled", "TIMEOUT": "timed out", "DEADLINE": "timed out",
                "PREEMPTED": "preempted", "NODE_FAIL": "node failed"}.get(base, "failed")
    why = [f"SLURM state {state}" if base not in ("FINISHED", "INTERRUPTED") else
           f"job process {state.lower()}"]
    error = _first_error(t.run_dir)
    if error:
        why.append(error)
    elif t.status == "failed":
        tail = _log_tail(t.job)
        if tail:
            why.append(tail)
    t.message = "; ".join(why)


def _first_error(run_dir: Path) -> str:
    """The first user error or crash note a rank recorded in the run dir."""
    folder = Path(run_dir) / ERRORS_DIR
    for path in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
        text = path.read_text().strip()
        if text:
            return text
    return ""


def _log_tail(job, lines: int = 12) -> str:
    """The end of the stderr of the first task whose log shows an error."""
    tasks = getattr(job, "_sub_jobs", None) or [job]
    for task in tasks:
        for path in (task.paths.stderr, task.paths.stdout):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            if "Traceback" in text or "error" in text.lower():
                tail = text.strip().splitlines()[-lines:]
                return f"end of {path}:\n" + "\n".join(tail)
    return f"see the logs in {tasks[0].paths.folder}" if tasks else ""


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def wait(tracked: list[Tracked], poll_s: float) -> None:
    """Polls until every job is over (each poll: one sacct call, then the result files)."""
    pending = list(tracked)
    while pending:
        refresh([t.job for t in pending])
        pending = [t for t in pending if not check(t)]
        if pending:
            time.sleep(poll_s)
