"""Prior preservation through two pipeline stages: files of a `prior_preservation` directory
train towards the base model's own prediction. A LoRA starts as the base model (its B matrices
are 0), so on a dataset that is all prior preservation every step's loss is exactly 0 and the
LoRA never moves; the same run without it trains (loss > 0, B leaves 0)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.cli import dpipe_train, metrics, train_args

pytestmark = pytest.mark.slow

RUN = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=2", "pipeline.micro_batches=2",
       "train.max_steps=3", "train.checkpoint_every_steps=0", "train.precision=fp32"]


def _b_matrices(run_dir):
    weights = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    return [t for k, t in weights.items() if "lora_B" in k]


def test_prior_preservation_targets_the_base_models_prediction(tmp_path):
    prior = dpipe_train(*train_args(tmp_path / "prior", *RUN, "dataset.prior_preservation=true"))
    assert prior.code == 0, prior.err[-3000:]
    assert [m["loss"] for m in metrics(tmp_path / "prior")] == [0.0, 0.0, 0.0]
    assert all(b.abs().max() == 0 for b in _b_matrices(tmp_path / "prior"))

    plain = dpipe_train(*train_args(tmp_path / "plain", *RUN))
    assert plain.code == 0, plain.err[-3000:]
    assert all(m["loss"] > 0 for m in metrics(tmp_path / "plain"))
    assert any(b.abs().max() > 0 for b in _b_matrices(tmp_path / "plain"))
