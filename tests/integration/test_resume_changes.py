"""A resume with a changed `optim.lr` trains with the new value from its first step, and
`metrics.jsonl` lists each step once; one with a changed `train.loss` trains on that loss.
Three `dpipe-train` calls: a straight run, then resumes of its middle checkpoint with another
learning rate and with another loss."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import dpipe_train, metrics, train_args

pytestmark = pytest.mark.slow

BASE = ["model=tiny_flux", "dataset=synthetic", "train.max_steps=4",
        "train.checkpoint_every_steps=2"]
LORA = "lora/pytorch_lora_weights.safetensors"


def _train(run_dir, *overrides: str):
    result = dpipe_train(*train_args(run_dir, *BASE, *overrides))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    return result


def test_resume_with_a_changed_lr_or_loss_trains_with_it_and_logs_each_step_once(tmp_path):
    run_dir = tmp_path / "run"
    _train(run_dir, "optim.lr=1e-3")
    straight = {m["step"]: m for m in metrics(run_dir)}
    straight_weights = load_file(run_dir / LORA)
    # As if killed while writing step 4's checkpoint: step 2's is the newest complete one, and
    # metrics.jsonl already holds steps 3 and 4.
    (run_dir / "checkpoints" / "step_00000004" / "COMPLETE").unlink()
    assert sorted(straight) == [1, 2, 3, 4]

    result = _train(run_dir, "optim.lr=5e-4")
    assert "optim.lr 0.001 -> 0.0005" in result.err + result.out
    resumed = metrics(run_dir)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4], "each step once"
    lr = {m["step"]: m["lr"] for m in resumed}
    assert lr == {1: 1e-3, 2: 1e-3, 3: 5e-4, 4: 5e-4}
    by_step = {m["step"]: m["loss"] for m in resumed}
    # Step 3's loss comes from step 2's weights (the checkpoint): the same; step 4's from
    # weights that step 3 moved at the new rate.
    assert by_step[3] == straight[3]["loss"]
    assert by_step[4] != straight[4]["loss"]
    weights = load_file(run_dir / LORA)
    assert weights.keys() == straight_weights.keys()
    assert any(not torch.equal(weights[k], straight_weights[k]) for k in weights)


    # Again from step 2, with Huber at a small threshold: each element's error is at most
    # delta * |error| instead of its square, so step 3's loss (the same weights) falls far below
    # the straight run's MSE.
    (run_dir / "checkpoints" / "step_00000004" / "COMPLETE").unlink()
    _train(run_dir, "optim.lr=5e-4", "train.loss=huber", "train.huber_delta=0.01")
    huber = {m["step"]: m["loss"] for m in metrics(run_dir)}
    assert 0 < huber[3] < 0.05 * straight[3]["loss"], (huber[3], straight[3]["loss"])
