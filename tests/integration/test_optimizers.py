"""Every `optim=<name>` trains a 2-stage tiny Flux LoRA through `dpipe-train` and resumes
exactly: a run to step 4 with a checkpoint at step 2, against the same run resumed from its
step-2 checkpoint. One sweep trains all of them and one sweep resumes them (one fork server
each: the libraries are imported twice, not once per run).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import Sweep, dpipe_train, metrics, train_args

pytestmark = pytest.mark.slow

OPTIMIZERS = ["adamw8bit", "adafactor", "came", "prodigy", "schedulefree_adamw", "muon"]
STEPS = 4
# min_8bit_size=1: the tiny model's adapters are smaller than bitsandbytes' 4096-element
# threshold, under which it keeps 32-bit states; the test must run the 8-bit path.
ARGS = ["model=tiny_flux", "dataset=synthetic", f"train.max_steps={STEPS}",
        "train.checkpoint_every_steps=2", "pipeline.stages=2", "pipeline.micro_batches=2",
        "optim.min_8bit_size=1", "train.progress_bar=false"]
EXPORT = Path("lora") / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Sweep:
    return Sweep(tmp_path_factory.mktemp("optimizers"), *ARGS,
                 f"optim={','.join(OPTIMIZERS)}", timeout=900)


@pytest.fixture(scope="module")
def resumed(straight, tmp_path_factory) -> Sweep:
    """The same sweep on copies of the straight runs cut back to their step-2 checkpoint (as a
    kill just after it leaves them), so that each point resumes from step 2."""
    sweep_dir = tmp_path_factory.mktemp("resumed")
    for point in straight.points:
        source = Path(point["run_dir"])
        copy = sweep_dir / source.relative_to(source.parent)
        shutil.copytree(source, copy)
        shutil.rmtree(copy / "checkpoints" / "step_00000004")
        shutil.rmtree(copy / "lora")
    sweep = Sweep(sweep_dir, *ARGS, f"optim={','.join(OPTIMIZERS)}", timeout=900)
    # Rank 0 of each point says it (a fresh start would give the same losses: seeded).
    assert sweep.result.err.count("resumed from") == len(OPTIMIZERS), sweep.result.err[-3000:]
    return sweep


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_trains_on_two_stages_and_resumes_exactly(name, straight, resumed):
    run_dir = straight.run_dir(f"optim={name}")
    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in steps)
    export = load_file(run_dir / EXPORT)
    # The adapters' B matrices start at zero: a trained one has moved.
    assert any(t.abs().sum() > 0 for k, t in export.items() if "lora_B" in k), name

    again = resumed.run_dir(f"optim={name}")
    by_step = {m["step"]: m["loss"] for m in metrics(again)}
    for m in steps[2:]:
        assert by_step[m["step"]] == m["loss"], f"{name}: step {m['step']} differs after resume"
    resumed_export = load_file(again / EXPORT)
    for key in export:
        assert torch.equal(export[key], resumed_export[key]), f"{name}: {key}"


def test_prodigy_logs_its_step_size_estimate(straight):
    steps = metrics(straight.run_dir("optim=prodigy"))
    d = [m["prodigy_d"] for m in steps]
    assert all(value > 0 for value in d)
    assert d[-1] > d[0]  # it grows from optim.d0 as it learns the scale of the problem


def test_param_groups_reach_the_stages_optimizers_by_the_diffusers_names(tmp_path):
    """A pattern over the diffusers names of the adapters sets their rate on both stages (the
    logged lr is the first group's); a pattern that names nothing stops the run, naming it."""
    result = dpipe_train(*train_args(tmp_path / "run", *ARGS[:-1], "train.max_steps=1",
                                     "optim.param_groups=[{match: 'lora_[AB]', lr: 3e-3}]"))
    assert result.code == 0, result.err[-3000:]
    assert [m["lr"] for m in metrics(tmp_path / "run")] == [3e-3]

    result = dpipe_train(*train_args(tmp_path / "typo", *ARGS[:-1], "train.max_steps=1",
                                     "optim.param_groups=[{match: lora_b, lr: 3e-3}]"))
    said = result.out + result.err
    assert result.code != 0
    assert "optim.param_groups[0].match='lora_b' is found in no trainable parameter" in said
    assert "lora_B" in said and "Traceback" not in said, said[-3000:]
