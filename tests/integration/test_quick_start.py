"""The README's quick start for real: the Makefile's `make demo` training command, as written
there, trains the tiny FLUX model on 2 CPU stages and leaves the outputs the README lists."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.cli import REPO, dpipe_train

pytestmark = pytest.mark.slow


def demo_overrides() -> list[str]:
    """The overrides of the `dpipe-train` line of the Makefile's demo recipe."""
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    line, = [l for l in recipe.group(1).splitlines() if "dpipe-train" in l]
    argv = shlex.split(line)
    return argv[[i for i, a in enumerate(argv) if a.endswith("dpipe-train")][0] + 1:]


def test_make_demo_trains_and_leaves_the_documented_outputs(tmp_path):
    run_dir = tmp_path / "demo"
    result = dpipe_train(f"hydra.run.dir={run_dir}", "train.progress_bar=false",
                         *demo_overrides(), timeout=400)
    assert result.code == 0, result.out + result.err
    for path in ("run.yaml", "metrics.jsonl", "checkpoints/step_00000030/COMPLETE",
                 "lora/pytorch_lora_weights.safetensors", "samples/index.html",
                 "samples/step_0/0.png", "samples/step_30/1.png"):
        assert (run_dir / path).exists(), path
