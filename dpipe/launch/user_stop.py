"""A user's stop (SIGINT, SIGTERM) of dpipe-train's own process, from its first line on.

Until the workers start, nothing of the run needs finishing: a stop ends the process with one
line and 128 + the signal's number (130, 143), never a traceback. While dpipe-train imports its
libraries (seconds of torch and Hydra, before any code could catch an exception) it exits there
and then; from `main()` on, the stop is raised as `StopRequested`, a KeyboardInterrupt, so that
the code on its way out cleans up as after a Ctrl-C (the run lock is released), and main()
reports it. While workers run, dpipe.launch.local handles the signals instead: the workers
finish the step, save a checkpoint and exit.
"""

from __future__ import annotations

import os
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_state = {"raise": False, "raised": False}


def install() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def raise_from_now() -> None:
    """From here on a stop raises StopRequested (the caller reports it with `message`)."""
    _state["raise"] = True


def message(signum: int) -> str:
    return f"stopped on {signal.Signals(signum).name} before training started"


def _on_signal(signum, frame) -> None:  # noqa: ARG001
    if not _state["raise"]:
        # os.write: the interrupted code may be inside a write to sys.stderr's buffer.
        os.write(2, f"{message(signum)}\n".encode())
        os._exit(128 + signum)
    if not _state["raised"]:  # once: a second signal must not interrupt the way out
        _state["raised"] = True
        raise StopRequested(signum)
