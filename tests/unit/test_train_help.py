"""`dpipe-train --help` and a misspelt key, through the installed `dpipe-train` as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.cli import REPO

DPIPE_TRAIN = str(REPO / ".venv" / "bin" / "dpipe-train")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DPIPE_TRAIN, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_help_is_dpipes_own_and_lists_every_group_and_option():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "Powered by Hydra" not in text and "+key=" not in text.replace("with `+key=`", "")
    assert "Fine-tunes a diffusion model" in text and "README.md" in text and "docs/models.md" in text
    joined = re.sub(r"\n {12}", " ", text)  # an option list wrapped over lines, as one line
    for folder in sorted(p for p in (REPO / "conf").iterdir() if p.is_dir()):
        line = next((l for l in joined.splitlines() if l.startswith(f"  {folder.name}:")), None)
        assert line is not None, f"group {folder.name} is not listed:\n{text}"
        listed = {o.rstrip("*") for o in line.split(":", 1)[1].replace(",", " ").split()}
        assert listed == {p.stem for p in folder.glob("*.yaml")}, line
    assert "tiny_flux*" in text and "adamw*" in text  # the defaults of conf/config.yaml
    examples = text.split("Examples:\n")[1].split("\n\n")[0]
    assert len(re.findall(r"^  dpipe-train ", examples, re.M)) == 5, examples


@pytest.mark.slow
def test_a_misspelt_key_names_the_keys_near_it():
    top = _run("optm.lr=1", "--cfg", "job")  # an option after the overrides, as users type it
    assert top.returncode == 2, top.stderr
    assert "error: unknown config key(s): 'optm.lr': did you mean 'optim'?" in top.stderr
    assert "valid keys of the run config: dataset, model, name, optim," in top.stderr
    nested = _run("--cfg", "job", "optim.lrr=1e-4")
    assert nested.returncode == 2, nested.stderr
    assert "did you mean 'optim.lr'?" in nested.stderr
    for proc in (top, nested):
        assert "+optm" not in proc.stderr and "+optim" not in proc.stderr
        assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
