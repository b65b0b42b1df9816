"""One training process group per run dir: the `<run_dir>/.lock` file of the process that owns it.

Two runs on one run dir would interleave metrics.jsonl and overwrite each other's checkpoints and
exports, so the process that owns a run dir (the local launcher, or the main rank under torchrun
or SLURM) takes this lock before it writes anything there, holds it for the run's life and
removes it at exit. A second run finds the lock and stops with a `RunDirBusy` naming the holder.

The lock is taken atomically: its full content is written to a private file, which is then
hard-linked to `.lock` (link fails if `.lock` exists, so of two runs starting at once exactly one
wins, and a reader never sees a half-written lock). Where the filesystem has no hard links, an
O_EXCL create does the same, with a short window in which the file is still empty.

A lock left by a run that died (kill -9, a lost node, a reboot) must not block the next run:
- on the holder's host, its PID is gone (or belongs to a newer process, or the host rebooted);
- from another host (a shared filesystem) the PID cannot be checked, so the holder refreshes the
  file's mtime every HEARTBEAT_S (a daemon thread) and a heartbeat older than STALE_S means it
  is gone; the margin also absorbs clock skew between hosts of up to ~STALE_S - HEARTBEAT_S;
- a SLURM job requeued (by dpipe at its time limit, or after a node failure) is the same job id
  with a higher SLURM_RESTART_COUNT: SLURM ends every process of one attempt before it starts the
  next, so the earlier attempt's lock is dead at once, wherever the new attempt runs.
Such a lock is taken over, and the taker says so in one log line. Two takers of one dead lock are
serialized by a second O_EXCL file, so that only one of them replaces it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from dpipe.errors import ConfigError, UserError

log = logging.getLogger("dpipe")

LOCK_NAME = ".lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0
# A takeover in progress; one older than this was left by a taker that died mid-takeover.
_TAKEOVER_STALE_S = 10.0


class RunDirBusy(UserError):
    """Another live run holds this run dir."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run dir's lock: what its file says, and its heartbeat (the file's mtime)."""

    host: str
    pid: int
    started: float  # unix time
    token: str  # tells this lock from a later one of the same process or PID
    boot_id: str = ""
    pid_namespace: str = ""
    pid_start: str = ""  # the process's start time in /proc (a reused PID has another)
    slurm_job_id: str = ""
    slurm_restart_count: int = 0
    heartbeat: float = 0.0  # not stored: the file's mtime when read

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.started, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"host {self.host}, PID {self.pid}{job}, since {since}"


_STORED_FIELDS = set(Holder.__dataclass_fields__) - {"heartbeat"}


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _proc_start(pid: int) -> str:
    """The start time of process `pid` in clock ticks since boot ('' where /proc cannot tell)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name in (...) may hold spaces


def _boot_id() -> str:
    return (_read_text(Path("/proc/sys/kernel/random/boot_id")) or "").strip()


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_process() -> Holder:
    return Holder(
        host=socket.gethostname(), pid=os.getpid(), started=time.time(), token=uuid.uuid4().hex,
        boot_id=_boot_id(), pid_namespace=_pid_namespace(), pid_start=_proc_start(os.getpid()),
        slurm_job_id=os.environ.get("SLURM_JOB_ID", ""),
        slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0),
    )


def read_holder(path: Path) -> Holder | None:
    """The holder recorded in the lock at `path`; None if there is no lock (any more).

    A lock that cannot be read (being written under O_EXCL, or damaged) is returned with
    pid 0 and its mtime as heartbeat: alive while fresh, stale as any other once old.
    """
    for attempt in range(20):
        text = _read_text(path)
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None
        if text is None:
            return None
        try:
            fields = json.loads(text)
            known = {k: v for k, v in fields.items() if k in _STORED_FIELDS}
            return Holder(**known, heartbeat=mtime)
        except (ValueError, TypeError):
            time.sleep(0.05)  # an O_EXCL writer between its create and its write
    return Holder(host="?", pid=0, started=mtime, token=f"unreadable:{mtime}", heartbeat=mtime)


def why_dead(holder: Holder, me: Holder, now: float | None = None) -> str | None:
    """Why the holder of a lock is known to have ended, or None if it may still run."""
    now = time.time() if now is None else now
    if (holder.slurm_job_id and holder.slurm_job_id == me.slurm_job_id
            and holder.slurm_restart_count < me.slurm_restart_count):
        return (f"it was attempt {holder.slurm_restart_count} of SLURM job {holder.slurm_job_id}, "
                f"which SLURM ended before requeueing it (this is attempt "
                f"{me.slurm_restart_count})")
    same_host = (holder.host == me.host and holder.pid > 0
                 and holder.pid_namespace == me.pid_namespace)
    if same_host and holder.boot_id and me.boot_id and holder.boot_id != me.boot_id:
        return "its host has restarted since"
    if same_host:
        if not _pid_alive(holder.pid):
            return "its process is gone"
        if holder.pid_start and _proc_start(holder.pid) not in ("", holder.pid_start):
            return "its process is gone (its PID now belongs to another process)"
        return None  # alive on this host: a hung run still holds its dir
    age = now - holder.heartbeat
    if age > STALE_S:
        return (f"its heartbeat stopped {age:.0f} s ago (it runs on another host, so only the "
                f"heartbeat can tell; a live run refreshes it every {HEARTBEAT_S:.0f} s)")
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


class RunLock:
    """The lock of one run dir, held by this process; `release()` (also run at exit) drops it."""

    def __init__(self, run_dir: Path, holder: Holder, inode: int):
        self.run_dir, self.holder, self.path = run_dir, holder, run_dir / LOCK_NAME
        self._inode = inode
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, daemon=True, name="dpipe-run-lock")
        self._heartbeat.start()
        atexit.register(self.release)

    def _is_mine(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self._inode
        except FileNotFoundError:
            return False

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._is_mine():
                log.warning("the lock of %s is no longer this run's: another run took it over "
                            "(this one stopped refreshing it for over %.0f s?)", self.run_dir,
                            STALE_S)
                return
            try:
                os.utime(self.path)
            except OSError:
                pass  # a filesystem hiccup: the next beat tries again

    def release(self) -> None:
        """Removes the lock if it is still this process's (a forked child never removes it)."""
        self._stop.set()
        atexit.unregister(self.release)
        if os.getpid() == self.holder.pid and self._is_mine():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(run_dir: Path) -> RunLock:
    """Takes the lock of `run_dir` for this process, or raises RunDirBusy naming its holder."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_NAME
    me = this_process()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(50):
            inode = _create(path, me)
            if inode is not None:
                return RunLock(run_dir, me, inode)
            holder = read_holder(path)
            if holder is None:
                continue  # released between our try and the read
            reason = why_dead(holder, me)
            if reason is None:
                raise RunDirBusy(busy_message(run_dir, holder))
            inode = _take_over(path, holder, me)
            if inode is not None:
                log.warning("took over the lock of %s from an earlier run (%s): %s",
                            run_dir, holder.describe(), reason)
                return RunLock(run_dir, me, inode)
            time.sleep(0.02)  # another taker is at it: see what it left
    except OSError as err:
        raise ConfigError(f"the run dir {run_dir} is not writable ({err.strerror}): choose "
                          "another (`name=...` or `hydra.run.dir=...`) or fix its "
                          "permissions") from None
    raise RunDirBusy(f"{run_dir} is in use: its lock {path} keeps changing hands; "
                     "is a run starting there again and again?")


def busy_message(run_dir: Path, holder: Holder) -> str:
    if holder.pid == 0:
        who = f"a run whose lock {run_dir / LOCK_NAME} cannot be read (written just now)"
    else:
        who = f"another dpipe-train ({holder.describe()})"
    return (f"{run_dir} is in use by {who}; wait for it to end or stop it, or train in another "
            f"run dir (`name=...` or `hydra.run.dir=...`). A lock left by a run that died is "
            f"taken over by itself: once its process is gone, or, from another host, "
            f"{STALE_S:.0f} s after its heartbeat stopped")


def _create(path: Path, me: Holder) -> int | None:
    """Makes `path` the lock of `me` if there is none; its inode, or None if one exists."""
    fields = {k: v for k, v in asdict(me).items() if k != "heartbeat"}
    # for a person reading the file; the heartbeat is its mtime
    fields["started_utc"] = datetime.fromtimestamp(me.started, timezone.utc).isoformat()
    content = json.dumps(fields, indent=1)
    tmp = path.with_name(f"{path.name}.{me.token}.tmp")
    tmp.write_text(content)
    try:
        os.link(tmp, path)  # atomic, and never a partial file
        return os.stat(tmp).st_ino
    except FileExistsError:
        return None
    except OSError:
        return _create_exclusive(path, content)  # no hard links on this filesystem
    finally:
        tmp.unlink(missing_ok=True)


def _create_exclusive(path: Path, content: str) -> int | None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
        return os.fstat(f.fileno()).st_ino


def _take_over(path: Path, dead: Holder, me: Holder) -> int | None:
    """Replaces the lock of `dead` by one of `me`, unless another taker was first (then None)."""
    guard = path.with_name(f"{path.name}.takeover")
    try:
        os.close(os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        try:
            if time.time() - guard.stat().st_mtime > _TAKEOVER_STALE_S:
                guard.unlink(missing_ok=True)  # its taker died mid-takeover
        except FileNotFoundError:
            pass
        return None
    try:
        current = read_holder(path)
        if current is not None:
            if current.token != dead.token:
                return None  # taken over, or released and taken, meanwhile
            path.unlink(missing_ok=True)
        return _create(path, me)
    finally:
        guard.unlink(missing_ok=True)
