"""One worker process of a run started by the local launcher (forked by its fork server, see
launch/local.py; `python -m dpipe.launch.worker DIR` runs one by hand)."""

from __future__ import annotations

import sys
from pathlib import Path

from dpipe.launch.quiet import quiet_libraries

from dpipe.launch.run_rank import RUN_CONFIG, exit_process, load_run_config, run_rank, train_job


def main() -> int:
    from dpipe.train import preemption

    preemption.install_local_stop()  # a user's SIGINT/SIGTERM: checkpoint the step, then stop
    quiet_libraries()
    run_dir = Path(sys.argv[1])
    return run_rank(train_job(load_run_config(run_dir / RUN_CONFIG), run_dir), run_dir)


if __name__ == "__main__":
    exit_process(main())
