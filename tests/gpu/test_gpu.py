"""GPU checks (skipped without CUDA): the tiny model through the real path on GPUs."""

from __future__ import annotations

import pytest
import torch

from tests.cli import dpipe_train, metrics, train_args

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BASE = ["model=tiny_flux", "dataset=synthetic", "train.precision=bf16", "train.max_steps=2",
        "pipeline.micro_batches=4", "train.checkpoint_every_steps=0"]


def _losses(run_dir, *overrides):
    result = dpipe_train(*train_args(run_dir, *BASE, *overrides), timeout=600)
    assert result.code == 0, result.err[-3000:]
    return torch.tensor([m["loss"] for m in metrics(run_dir)])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_stage_gpu_run_matches_one_stage_in_bf16(tmp_path):
    one = _losses(tmp_path / "one", "pipeline.stages=1", "pipeline.data_parallel=1")
    two = _losses(tmp_path / "two", "pipeline.stages=2", "pipeline.data_parallel=1")
    torch.testing.assert_close(two, one, rtol=2e-2, atol=1e-3)


def test_compiled_blocks_match_eager_blocks(tmp_path):
    eager = _losses(tmp_path / "eager", "pipeline.stages=1", "pipeline.data_parallel=1")
    compiled = _losses(tmp_path / "compiled", "pipeline.stages=1", "pipeline.data_parallel=1",
                       "pipeline.compile=true")
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=1e-3)


def test_auto_checkpointing_matches_no_checkpointing(tmp_path):
    none = _losses(tmp_path / "none", "pipeline.stages=1", "pipeline.data_parallel=1")
    auto = _losses(tmp_path / "auto", "pipeline.stages=1", "pipeline.data_parallel=1",
                   "pipeline.activation_checkpointing=auto", "pipeline.memory_budget_gb=0.001")
    torch.testing.assert_close(auto, none, rtol=2e-2, atol=1e-3)
