"""Starts the worker processes of a run on this machine: one per GPU, or CPU processes (gloo).

The user never types torchrun or deepspeed. Each worker runs `dpipe.launch.worker` on the run
dir, reading the resolved config that the launcher saved there. If any worker fails, the others are
stopped (they would wait forever in a collective) and the user errors they recorded are reported
once each.

Workers are forked from a fork server (multiprocessing's "forkserver") that imported torch,
DeepSpeed, diffusers and transformers once (`dpipe.launch.preload`): a worker starts in well under
a second instead of importing them itself (~8 s of CPU each), and the workers of one run share
those modules' memory. The server is a fresh interpreter, not a fork of this process, and nothing
it imports touches the GPU, so each worker initializes CUDA itself as if it had been spawned. It
lives as long as this process: the points of a sweep reuse it. Each worker gets this process's
environment of the moment; only what the preloaded libraries read when imported is fixed by the
first run. A worker's parent is the fork server, not this process, so each worker watches a pipe
from this process and ends itself when that closes (this process died, even by SIGKILL). It
writes to this process's stdout and stderr and works in its working directory as they are at the
launch (`_LauncherIO`), not as they were when the server started: a second launch from one process
(a sweep's next point, or a program that calls `dpipe.cli.train.main` again with its output
elsewhere) gets its workers' output where its own goes.

A user's stop (`graceful_stop`, training): the first SIGINT (Ctrl-C) or SIGTERM reaches every
worker through its pipe, whenever it came (a worker not yet started reads it once it is): each
raises the flag of dpipe.train.preemption, the ranks agree on a step, save it and exit, and
`Stopped` tells the caller. A stop before every worker started ends the started ones (they are
still waiting for the others, with nothing written). A second signal kills the workers at once.
The same signal sent to the whole process group (a terminal's Ctrl-C; systemd, `scancel`,
`timeout` and `kill -- -PGID` send SIGTERM so) gives the same result: the fork server ignores
both signals (it must outlive the workers, which it reports the exit codes of), the workers
ignore them until they installed their own handler, which only raises the flag.

The workers meet at a rendezvous store that this process hosts (`hosted_store`), as torchrun's
agent does, rather than at one that rank 0 opens on a port picked in advance.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
from multiprocessing import forkserver, reduction, resource_tracker
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from dpipe.config.schema import RunConfig
from dpipe.errors import ConfigError
from dpipe.launch.console_log import LOG_FILE_ENV, run_log_file, tee_console
from dpipe.launch.run_rank import USER_ERROR_SIGNAL, error_folders
from dpipe.launch.user_stop import STOP_SIGNALS, StopRequested

ERRORS_DIR = ".errors"


def world_size_for(run: RunConfig, gpus: int) -> int:
    stages, dp = run.pipeline.stages, run.pipeline.data_parallel
    if gpus == 0:
        return stages * (dp or 1)
    if dp is None:
        if gpus < stages:
            raise ConfigError(f"pipeline.stages={stages} needs at least {stages} GPUs; found {gpus}")
        dp = gpus // stages
    if stages * dp > gpus:
        raise ConfigError(
            f"pipeline.stages x pipeline.data_parallel = {stages * dp} GPUs, but {gpus} are visible"
        )
    return stages * dp


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# Under this variable torch's rendezvous connects every rank to a store it does not host, as under
# torchrun, whose agent hosts it.
WORKERS_USE_HOSTED_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


@contextmanager
def hosted_store():
    """Yields the port of a rendezvous store that this process hosts for its workers' lifetime.

    Why not pick a free port and let rank 0 bind it: between the pick and the bind another process
    can take the port (a parallel run, or one of gloo's own connections, which draw from the same
    ephemeral range), and rank 0 fails with EADDRINUSE. Binding port 0 here and keeping the socket
    leaves no such window. The workers need WORKERS_USE_HOSTED_STORE in their environment.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


# What the launcher writes into a worker's pipe to stop it at the next step.
STOP_MESSAGE = b"stop"


class Stopped(Exception):
    """The user stopped the run with `signum`; every worker has ended. `forced`: by a second
    signal, the workers killed without a checkpoint of the step they were in."""

    def __init__(self, signum: int, forced: bool):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.forced = signum, forced


def launch_workers(run_dir: Path, world_size: int, module: str = "dpipe.launch.worker",
                   graceful_stop: bool = False) -> int:
    """Runs the workers to completion; returns 0, or the exit code of the first that failed.

    `module` is the worker's entry point: its `main()` reads the run dir from sys.argv[1].
    `graceful_stop`: SIGINT/SIGTERM are forwarded to the workers (which must stop at a step and
    exit 0, as training's do), and raise `Stopped` once they have ended, or StopRequested if
    they came before every worker started.
    """
    errors = error_folders(run_dir, str(os.getpid()))
    for folder in errors:
        for old in folder.glob("*.txt") if folder.exists() else []:
            old.unlink()
    procs = []
    # One pipe per worker; only this process holds the writing ends: when it dies, even by
    # SIGKILL, every worker reads end-of-file and stops (they would otherwise train on as orphans
    # of the fork server). A stop is written into them (`_tell_stop`).
    writers = []
    user_error = []
    previous = signal.signal(USER_ERROR_SIGNAL, lambda *_: user_error.append(True))
    stops: list[int] = []

    def record_stop(signum, frame) -> None:  # noqa: ARG001
        stops.append(signum)  # acted on by _wait (a second one: the workers are killed)

    previous_stop = {sig: signal.signal(sig, record_stop)
                     for sig in (STOP_SIGNALS if graceful_stop else ())}
    log_file = run_log_file()  # the workers copy their console output into it
    log_env = {LOG_FILE_ENV: str(log_file)} if log_file is not None else {}
    try:
        context = _fork_server()
        with hosted_store() as port:
            for rank in range(world_size):
                if stops:  # before every worker started: those started wait at the rendezvous
                    break
                env = dict(os.environ, **WORKERS_USE_HOSTED_STORE, **log_env,
                           DPIPE_LAUNCHER_PID=str(os.getpid()), RANK=str(rank),
                           WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port))
                launcher_alive, writer = context.Pipe(duplex=False)
                writers.append(writer)
                proc = context.Process(target=_run_worker, name=f"dpipe-rank{rank}",
                                       args=(module, str(run_dir), env, launcher_alive,
                                             _LauncherIO()))
                proc.start()
                procs.append(proc)
                launcher_alive.close()
            started = len(procs) == world_size  # a stop that came later is told to them all
            code = _wait(procs, writers, user_error, stops) if started else None
    except BaseException:
        _stop(procs)
        raise
    finally:
        signal.signal(USER_ERROR_SIGNAL, previous)
        for sig, handler in previous_stop.items():
            signal.signal(sig, handler)
        for writer in writers:
            writer.close()
    if code is None:  # stopped before every worker started: nothing to save
        _stop(procs)
        _end_fork_server()  # it may be importing still, deaf to signals, for seconds
        raise StopRequested(stops[0])
    if len(stops) > 1:
        _stop(procs)
        raise Stopped(stops[0], forced=True)
    if code:
        _stop(procs)
        _report_errors(errors)
    elif stops:
        raise Stopped(stops[0], forced=False)
    return code


def _fork_server():
    """The forkserver context, its server importing `dpipe.launch.preload` when it starts."""
    if "DS_ACCELERATOR" not in os.environ:
        # DeepSpeed picks its accelerator when imported; its probe would initialize CUDA in the
        # server, and CUDA does not survive a fork.
        os.environ["DS_ACCELERATOR"] = "cuda" if _has_gpu() else "cpu"
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch.cuda.is_available() stays fork-safe
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dpipe.launch.preload"])
    # The server starts with the stop signals blocked: until the preload made it ignore them, a
    # Ctrl-C would interrupt its imports with a traceback and a SIGTERM would end it (and with
    # it the exit codes of its workers). A signal meant for this process stays pending meanwhile.
    # The resource tracker starts first, outside that window: starting it, `ensure_running`
    # unblocks both signals (CPython's resource_tracker), which let a stop sent to the whole
    # group reach the server's start-up (a traceback from its `site` import, seen under load).
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return context


def _end_fork_server() -> None:
    """Ends the fork server now rather than once its preload is done and it notices that this
    process has gone; the next launch starts a new one."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _LauncherIO:
    """The launcher's stdout, stderr and working directory at a launch, for a worker to take."""

    def __init__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.cwd = os.getcwd()

    def __reduce__(self):  # as the worker starts: the fork server passes both fds on to it
        return _LauncherIO._received, (reduction.DupFd(1), reduction.DupFd(2), self.cwd)

    @classmethod
    def _received(cls, stdout, stderr, cwd: str) -> "_LauncherIO":
        taken = cls.__new__(cls)
        taken.cwd, taken.fds = cwd, (stdout.detach(), stderr.detach())
        return taken

    def take(self) -> None:
        """This worker writes where the launcher does and works where it does."""
        for fd, received in zip((1, 2), self.fds):
            os.dup2(received, fd)
            os.close(received)
        os.chdir(self.cwd)


def _run_worker(module: str, run_dir: str, env: dict, launcher_alive,
                launcher_io: _LauncherIO) -> None:
    """A forked worker: this rank's environment and arguments, then the entry point's main()."""
    launcher_io.take()
    threading.Thread(target=_watch_launcher, args=(launcher_alive,), daemon=True,
                     name="dpipe-launcher-watch").start()
    os.environ.clear()
    os.environ.update(env)
    if env.get(LOG_FILE_ENV):
        tee_console(env[LOG_FILE_ENV])
    sys.argv = [module, run_dir]
    entry = importlib.import_module(module)
    from dpipe.launch.run_rank import exit_process

    exit_process(entry.main())


def _watch_launcher(launcher_alive) -> None:
    """Raises the stop flag when the launcher says so; ends this worker at once when the
    launcher's end of the pipe closes."""
    while True:
        try:
            message = launcher_alive.recv_bytes()
        except (EOFError, OSError):
            break
        if message == STOP_MESSAGE:
            from dpipe.train import preemption

            preemption.request()
    os.kill(os.getpid(), signal.SIGKILL)


def _wait(procs, writers, user_error: list, stops: list) -> int:
    told = False
    while True:
        if user_error:
            return 2
        if len(stops) > 1:
            return 128 + stops[0]
        if stops and not told:  # here, not in the handler: printing there can re-enter stderr
            print(f"dpipe: {signal.Signals(stops[0]).name}: finishing the step and saving a "
                  "checkpoint; send it again to stop at once", file=sys.stderr, flush=True)
            _tell_stop(writers)
            told = True
        codes = [p.exitcode for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _tell_stop(writers) -> None:
    for writer in writers:
        try:
            writer.send_bytes(STOP_MESSAGE)
        except OSError:  # that worker has ended
            pass


def _stop(procs) -> None:
    for p in procs:
        if p.exitcode is None:
            p.kill()  # they may be blocked in a collective: no grace needed
    deadline = time.monotonic() + 10
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))


def _report_errors(folders: list[Path]) -> None:
    seen = []
    for folder in folders:
        for path in sorted(folder.glob("*.txt")) if folder.exists() else []:
            message = path.read_text().strip()
            if message and message not in seen:
                seen.append(message)
    shutil.rmtree(folders[-1], ignore_errors=True)  # the temp dir's: this launcher's alone
    log_file = run_log_file()
    for message in seen:
        print(f"error: {message}", file=sys.stderr)
        if log_file is not None:  # what the console shows, the run's log holds
            with open(log_file, "a", encoding="utf-8") as f:
                f.write(f"error: {message}\n")
