"""One worker process of a run started by the local launcher (forked by its fork server, see
launch/local.py; `python -m dpipe.launch.worker DIR` runs one by hand)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from dpipe.launch.quiet import quiet_libraries

from dpipe.launch.run_rank import RUN_CONFIG, exit_process, load_run_config, run_rank


def _die_with_launcher() -> None:
    """If the launcher is killed (even by SIGKILL), its workers must not train on as orphans."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the launcher's own cleanup still covers normal exits
        pass
    if os.getppid() == 1:  # the launcher died before prctl took effect
        sys.exit(1)


def main() -> int:
    _die_with_launcher()
    quiet_libraries()
    run_dir = Path(sys.argv[1])
    return run_rank(load_run_config(run_dir / RUN_CONFIG), run_dir)


if __name__ == "__main__":
    exit_process(main())
