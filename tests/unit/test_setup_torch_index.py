"""`make setup`'s choice of torch build (scripts/torch_index.sh): the CPU index on a Linux
machine with no NVIDIA driver, unless DPIPE_TORCH_INDEX says otherwise or pip's own indexes
already give a CPU build (as on CI, from a local +cpu wheel)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import REPO

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or os.path.exists("/proc/driver/nvidia"),
    reason="the choice for a Linux machine without an NVIDIA driver")


def _fake_python(folder: Path, version: str) -> Path:
    """A python whose `-m pip install --dry-run --report -` resolves torch to `version`."""
    folder.mkdir(exist_ok=True)
    report = json.dumps({"install": [{"metadata": {"name": "torch", "version": version}}]})
    path = folder / "python"
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = -m ]; then echo '{report}'; exit 0; fi\n"
                    f"exec {sys.executable} \"$@\"\n")
    path.chmod(0o755)
    return path


def _choose(python: Path, path: str, **env) -> list[str]:
    env = {**{k: v for k, v in os.environ.items() if k != "DPIPE_TORCH_INDEX"}, "PATH": path,
           **env}
    done = subprocess.run(
        ["bash", "-c", 'source scripts/torch_index.sh && choose_torch_index "$0" torch==2.13.0',
         str(python)], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_no_nvidia_driver_gets_the_cpu_build_unless_told(tmp_path):
    plain = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                            if not (Path(p) / "nvidia-smi").exists())
    cuda = _fake_python(tmp_path / "pypi", "2.13.0")  # PyPI's Linux torch: the CUDA build
    assert _choose(cuda, plain) == [
        "https://download.pytorch.org/whl/cpu",
        "no NVIDIA driver (no nvidia-smi, no /proc/driver/nvidia): the CPU build"]
    assert _choose(cuda, plain, DPIPE_TORCH_INDEX="https://download.pytorch.org/whl/cu130") == [
        "https://download.pytorch.org/whl/cu130", "DPIPE_TORCH_INDEX is set"]

    driver = tmp_path / "bin"
    driver.mkdir()
    (driver / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (driver / "nvidia-smi").chmod(0o755)
    assert _choose(cuda, f"{driver}{os.pathsep}{plain}") == [
        "", "an NVIDIA driver is present: pip's own index (PyPI's torch is a CUDA build)"]

    local = _fake_python(tmp_path / "local", "2.13.0+cpu")  # CI: a local CPU wheel
    assert _choose(local, plain) == [
        "", "no NVIDIA driver, and pip's own indexes give a CPU build (2.13.0+cpu)"]
