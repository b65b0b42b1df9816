"""Activation checkpointing (pipeline.activation_checkpointing) with the video families' layers in
a real 2-stage run: recomputing the layers in backward gives the same training as keeping their
activations (losses of 3 steps equal, so gradients and updates were equal too)."""

from __future__ import annotations

import pytest

from tests.cli import Sweep, metrics

MODELS = ["tiny_hunyuan_video", "tiny_ltx_video"]


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_checkpointed_layers_train_identically(model, tmp_path):
    sweep = Sweep(tmp_path, f"model={model}", "dataset=synthetic", "pipeline.stages=2",
                  "pipeline.micro_batches=2", "optim.lr=1e-3", "train.checkpoint_every_steps=0",
                  "train.max_steps=3", "train.progress_bar=false",
                  "pipeline.activation_checkpointing=none,all",
                  *(["model.i2v=true"] if "ltx" in model else []))
    plain, recomputed = ([m["loss"] for m in metrics(sweep.run_dir(
        f"pipeline.activation_checkpointing={mode}"))] for mode in ("none", "all"))
    assert len(plain) == 3
    assert recomputed == pytest.approx(plain, rel=1e-5, abs=1e-7)
