"""A run whose loss or gradients stop being finite stops with a clear error before it writes a
checkpoint of the diverged weights, keeping the good ones (dpipe.train.divergence)."""

from __future__ import annotations

import math

import pytest

from tests.cli import dpipe_train, metrics, train_args

pytestmark = pytest.mark.slow


def test_a_diverging_run_stops_before_checkpointing_nan_weights(tmp_path):
    """optim.lr=1e30: the first update leaves the LoRA weights finite but ~1e30, so the second
    step's activations overflow. Two pipeline stages, each rank deciding on its own."""
    run = tmp_path / "run"
    result = dpipe_train(*train_args(run, "pipeline.stages=2", "pipeline.data_parallel=1",
                                     "optim.lr=1e30", "train.max_steps=4",
                                     "train.checkpoint_every_steps=1", "train.log_every=3"))
    assert result.code == 2, f"exit {result.code}\n{result.out}\n{result.err[-3000:]}"
    assert "Traceback" not in result.err and "leaked" not in result.err, result.err[-3000:]
    step1 = run / "checkpoints" / "step_00000001"
    for fragment in ("step 2: the loss is nan", "without checkpointing this step",
                     f"step 1 ({step1})", "a lower optim.lr (now 1e+30)"):
        assert fragment in result.err, f"{fragment!r} not in:\n{result.err[-3000:]}"
    # Step 2 is not a logged one (log_every=3): the check before its checkpoint stopped it.
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000001"]
    assert not (run / "lora").exists()  # nor exported
    assert metrics(run) == []


def test_a_logged_step_that_diverges_is_in_the_log(tmp_path):
    run = tmp_path / "run"
    result = dpipe_train(*train_args(run, "pipeline=single", "optim.lr=1e30",
                                     "train.max_steps=4", "train.checkpoint_every_steps=0"))
    assert result.code == 2, f"exit {result.code}\n{result.out}\n{result.err[-3000:]}"
    assert "step 2: the loss is nan" in result.err and "no checkpoint was written" in result.err
    logged = metrics(run)
    assert [m["step"] for m in logged] == [1, 2] and math.isnan(logged[1]["loss"])
