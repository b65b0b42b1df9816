"""Runs dpipe's commands for the tests: their command lines, exit codes, what they printed.

`dpipe_command("dpipe-sample", ...)` (and `dpipe_train(...)`) calls the console script's `main()`
(pyproject.toml's [project.scripts]) in this process with the given arguments: the code path of
the typed command, without its start-up. The workers are real processes, as always, forked by a
fork server that this process keeps from run to run as a sweep does, so a run saves the ~10 s of
CPU of importing torch, DeepSpeed, diffusers and Hydra twice (the launcher and its fork server).
What the run changes in this process (arguments, working directory, environment, signal
handlers, Hydra's global state, loggers, stdout and stderr) is put back after it.
`train_killed_at` and the tests of signals, locks and typed commands start real processes.
"""

from __future__ import annotations

import copy
import functools
import importlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    code: int
    out: str
    err: str


def train_args(run_dir: Path, *overrides: str) -> list[str]:
    return [f"hydra.run.dir={run_dir}", "train.progress_bar=false", *overrides]


def dpipe_train(*args: str, timeout: float = 240, cwd: Path | None = None) -> Result:
    return dpipe_command("dpipe-train", *args, timeout=timeout, cwd=cwd)


@functools.cache
def _console_scripts() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def dpipe_command(script: str, *args: str, timeout: float = 240, cwd: Path | None = None) -> Result:
    """`SCRIPT ARGS` (e.g. "dpipe-sample", "run=...") run in `cwd` (the repository by default);
    a run past `timeout` seconds is stopped as a user would (Ctrl-C, then again) and fails."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton

    from dpipe.launch import user_stop

    module, function = _console_scripts()[script].split(":")
    timed_out = threading.Event()
    timer = threading.Timer(timeout, _interrupt_twice, args=(timed_out,))
    argv, cwd_before, environ = sys.argv, os.getcwd(), dict(os.environ)
    stop_state = dict(user_stop._state)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    global_hydra = copy.deepcopy(Singleton._instances.get(GlobalHydra))
    code = 0
    with _captured_output() as output:
        try:
            sys.argv = [script, *args]
            os.chdir(cwd or REPO)
            timer.start()
            # as the console script does: sys.exit(main())
            code = _exit_code(getattr(importlib.import_module(module), function)())
        except SystemExit as done:
            code = _exit_code(done.code)
        except BaseException:  # as the interpreter reports an uncaught exception
            traceback.print_exc()
            code = 1
        finally:
            timer.cancel()
            sys.argv = argv
            os.chdir(cwd_before)
            os.environ.clear()
            os.environ.update(environ)
            user_stop._state.clear()
            user_stop._state.update(stop_state)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            Singleton._instances.pop(GlobalHydra, None)  # Hydra's global state, as it was
            if global_hydra is not None:
                Singleton._instances[GlobalHydra] = global_hydra
    if timed_out.is_set():
        raise AssertionError(f"{script} timed out after {timeout}s\n{output.out}\n{output.err}")
    return Result(code, output.out, output.err)


def _interrupt_twice(timed_out: threading.Event) -> None:
    """A timed-out run: stopped as by Ctrl-C, its workers killed by a second one."""
    timed_out.set()
    for _ in range(2):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter prints it
    return 1


class _Output:
    out = err = ""


@contextmanager
def _captured_output():
    """stdout and stderr of this process, file descriptors included (the workers write to
    them), into files; logging as a new process has it (no handler on the root logger, so that
    a command's own `logging.basicConfig` takes effect), and as it was again after."""
    loggers = _loggers()
    before = {logger: (list(logger.handlers), logger.level, logger.propagate, logger.disabled)
              for logger in loggers}
    root = logging.getLogger()
    root.handlers[:] = []
    root.setLevel(logging.WARNING)
    output = _Output()
    sys.stdout.flush()
    sys.stderr.flush()
    streams, fds = (sys.stdout, sys.stderr), (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = io.TextIOWrapper(os.fdopen(os.dup(1), "wb"), line_buffering=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(2), "wb"), line_buffering=True)
        try:
            yield output
        finally:
            for logger in _loggers():
                if logger in before:
                    handlers, level, logger.propagate, logger.disabled = before[logger]
                    logger.setLevel(level)
                else:  # made by a module the command imported: as it set itself up, but for
                    # handlers on this output, whose files are about to close
                    handlers = [h for h in logger.handlers
                                if getattr(h, "stream", None) not in (sys.stdout, sys.stderr)]
                for handler in logger.handlers:
                    if handler not in handlers:
                        handler.close()
                logger.handlers[:] = handlers
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
                stream.close()
            sys.stdout, sys.stderr = streams
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            for fd in fds:
                os.close(fd)
            for file, name in ((out, "out"), (err, "err")):
                file.seek(0)
                setattr(output, name, file.read().decode(errors="replace"))


def _loggers() -> list[logging.Logger]:
    return [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                   if isinstance(logger, logging.Logger))]


def train_killed_at(run_dir: Path, marker: str, *overrides: str, timeout: float = 240) -> None:
    """Starts `dpipe-train` on `run_dir` with `overrides` and kills its whole process tree
    (SIGKILL, no warning) the moment `run_dir / marker` exists (e.g. a checkpoint's COMPLETE)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpipe.cli.train", *train_args(run_dir, *overrides)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not (run_dir / marker).exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, f"no {marker} appeared"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every worker
    proc.wait()


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Sweep:
    """The points of one `dpipe-train -m hydra.sweep.dir=DIR ...` sweep.

    Runs that differ in a few overrides are one sweep: its points run one after another in one
    process, their workers forked by one fork server that imported the libraries once.
    """

    def __init__(self, sweep_dir: Path, *args: str, timeout: float = 1200):
        self.result = dpipe_train("-m", f"hydra.sweep.dir={sweep_dir}", *args, timeout=timeout)
        summary = sweep_dir / "sweep_summary.json"
        assert summary.is_file(), f"the sweep wrote no summary:\n{self.result.out}\n{self.result.err}"
        self.points = json.loads(summary.read_text())["points"]

    def run_dir(self, *overrides: str) -> Path:
        """The run dir of the point with these overrides (e.g. "model=tiny_flux"); fails, saying
        why, if that point did not complete."""
        point, = [p for p in self.points if set(overrides) <= set(p["overrides"])]
        assert point["status"] == "completed", (
            f"{' '.join(overrides)}: {point['status']}: {point['message']}\n"
            f"{self.result.err[-5000:]}")
        return Path(point["run_dir"])


def bench_rows(out: Path, runs: dict[str, str], *flags: str, timeout: float = 300) -> dict[str, dict]:
    """`dpipe-bench --size tiny` over `runs` ({name: overrides}): its result row per name."""
    args = ["--size", "tiny", "--warmup", "1", "--steps", "2", "--out", str(out), *flags]
    for name, overrides in runs.items():
        args += ["--run", f"{name}: {overrides}"]
    done = dpipe_command("dpipe-bench", *args, timeout=timeout)
    assert done.code == 0, done.out + done.err
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())}
    assert [r.get("error") for r in rows.values()] == [None] * len(runs), done.out + done.err
    return rows
