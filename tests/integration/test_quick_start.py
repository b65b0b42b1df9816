"""The README's quick start for real: the Makefile's `make demo` training command, as written
there, trains the tiny FLUX model on 2 CPU stages, leaves the outputs the README lists, and
visibly learns: its eval loss falls and its samples turn from noise to the prompts' colours."""

from __future__ import annotations

import json
import re
import shlex

import numpy as np
import pytest
from PIL import Image

from dpipe.data.synthetic import COLOURS
from tests.cli import REPO, dpipe_train
from tests.integration.test_documented_commands import documented_command

pytestmark = pytest.mark.slow

LAST = 120  # conf/train/demo.yaml's max_steps


def demo_overrides() -> list[str]:
    """The overrides of the `dpipe-train` line of the Makefile's demo recipe."""
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    line, = [l for l in recipe.group(1).splitlines() if "dpipe-train" in l]
    argv = shlex.split(line)
    return argv[[i for i, a in enumerate(argv) if a.endswith("dpipe-train")][0] + 1:]


def colour_distance(picture, prompt: str) -> float:
    """Mean distance (0-255 per channel, RGB) of each pixel to the nearest colour the prompt
    names: 0 for a picture in exactly the prompt's colours."""
    named = np.array([COLOURS[w] for w in re.findall(r"\w+", prompt) if w in COLOURS], float)
    pixels = np.asarray(Image.open(picture).convert("RGB"), float)
    return float(np.linalg.norm(pixels[:, :, None] - named, axis=-1).min(-1).mean())


def test_make_demo_trains_learns_and_leaves_the_documented_outputs(tmp_path):
    # README's demo command, which test_documented_commands maps to one step and leaves to this
    # test: the Makefile's line, run to its end
    documented = documented_command("dpipe-train train=demo sample=demo train.max_steps=1")
    assert [*demo_overrides(), "train.max_steps=1"] == list(documented.args)
    run_dir = tmp_path / "demo"
    result = dpipe_train(f"hydra.run.dir={run_dir}", "train.progress_bar=false",
                         *demo_overrides(), timeout=400)
    assert result.code == 0, result.out + result.err
    for path in ("run.yaml", "metrics.jsonl", "eval.jsonl",
                 f"checkpoints/step_{LAST:08d}/COMPLETE", "model/transformer/config.json",
                 "samples/index.html", "samples/step_0/0.png", f"samples/step_{LAST}/1.png"):
        assert (run_dir / path).exists(), path

    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals][::len(evals) - 1] == [0, LAST]
    first, last = evals[0]["shapes/mean"], evals[-1]["shapes/mean"]
    assert last <= first * 2 / 3, f"eval loss {first:.3f} -> {last:.3f}: fell by less than a third"

    samples = run_dir / "samples"
    for item in json.loads((samples / "step_0" / "prompts.json").read_text()):
        before, after = (colour_distance(samples / f"step_{n}" / f"{item['index']}.png",
                                         item["prompt"]) for n in (0, LAST))
        assert after < before, f"{item['prompt']}: colour distance {before:.1f} -> {after:.1f}"
    page = (samples / "index.html").read_text()
    assert "width: 256px" in page and "image-rendering: pixelated" in page  # 64 px enlarged
