"""Activation checkpointing (pipeline.activation_checkpointing) with the video families' layers in
a real 2-stage run: recomputing the layers in backward gives the same training as keeping their
activations (losses of 3 steps equal, so gradients and updates were equal too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli import dpipe_train, metrics, train_args

MODELS = ["tiny_hunyuan_video", "tiny_ltx_video"]


def _losses(run_dir: Path, model: str, checkpointing: str) -> list[float]:
    result = dpipe_train(*train_args(
        run_dir, f"model={model}", "dataset=synthetic", "pipeline.stages=2",
        "pipeline.micro_batches=2", "optim.lr=1e-3", "train.checkpoint_every_steps=0",
        "train.max_steps=3", f"pipeline.activation_checkpointing={checkpointing}",
        *(["model.i2v=true"] if "ltx" in model else []),
    ))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    return [m["loss"] for m in metrics(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_checkpointed_layers_train_identically(model, tmp_path):
    plain = _losses(tmp_path / "plain", model, "none")
    recomputed = _losses(tmp_path / "all", model, "all")
    assert len(plain) == 3
    assert recomputed == pytest.approx(plain, rel=1e-5, abs=1e-7)
