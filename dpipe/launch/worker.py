"""One worker process of a run started by the local launcher: `python -m dpipe.launch.worker DIR`."""

from __future__ import annotations

import sys
from pathlib import Path

from dpipe.launch.run_rank import RUN_CONFIG, run_rank, load_run_config


def main() -> int:
    run_dir = Path(sys.argv[1])
    return run_rank(load_run_config(run_dir / RUN_CONFIG), run_dir)


if __name__ == "__main__":
    sys.exit(main())
