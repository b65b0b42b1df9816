"""One worker process of `dpipe-sample` (started by the local launcher, as training's are)."""

from __future__ import annotations

import sys
from pathlib import Path

from dpipe.launch.quiet import quiet_libraries
from dpipe.launch.run_rank import exit_process, run_rank


def main() -> int:
    quiet_libraries()
    from dpipe.sample.job import SampleJob, run_sampling

    job_dir = Path(sys.argv[1])
    job = SampleJob.load(job_dir)
    return run_rank(lambda: run_sampling(job), job_dir)


if __name__ == "__main__":
    exit_process(main())
