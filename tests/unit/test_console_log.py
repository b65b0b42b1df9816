"""The run's log file holds what the console shows: the workers' output, not only the
launcher's records (dpipe.launch.console_log)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# As dpipe-train runs it: Hydra's job log on the root logger, then the local launcher's workers.
# The "early" logger's handler is made before the workers start, as DeepSpeed's is made when the
# fork server imports it.
LAUNCHER = """
import logging, sys
from pathlib import Path
from dpipe.launch.local import launch_workers
run_dir = Path(sys.argv[1])
logging.basicConfig(level=logging.INFO, handlers=[
    logging.StreamHandler(), logging.FileHandler(run_dir / "train.log")])
early = logging.getLogger("early")
early.addHandler(logging.StreamHandler(sys.stdout))
early.propagate = False
logging.getLogger("launcher").info("launcher record")
sys.exit(launch_workers(run_dir, 2, module="tests.unit.console_log_worker"))
"""


@pytest.mark.slow  # ~20 s: the fork server imports torch, DeepSpeed and diffusers
def test_train_log_holds_the_workers_console_output(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "launcher record" in log
    for rank in (0, 1):
        for line in (f"printed by rank {rank}", f"caching rank {rank}: 100%",
                     f"logged by rank {rank}", f"warned by rank {rank}"):
            assert line in log, (line, log)
            assert line in proc.stdout + proc.stderr  # still on the console too
        assert f"caching rank {rank}: 50%" not in log  # the bar's end state only
        assert f"caching rank {rank}: 50%" in proc.stderr
