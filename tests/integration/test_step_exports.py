"""Intermediate exports through `dpipe-train`: `lora/step_<N>/` every `train.export_every_steps`,
pruned to `train.keep_exports`, kept by the final export and by a resumed run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import dpipe_train, train_args

pytestmark = pytest.mark.slow

# A learning rate large enough that one step moves the adapters measurably.
BASE = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=2", "optim.lr=1e-3",
        "train.export_every_steps=2", "train.keep_exports=1", "train.checkpoint_every_steps=2"]
WEIGHTS = "pytorch_lora_weights.safetensors"


def _train(run_dir: Path, max_steps: int) -> str:
    result = dpipe_train(*train_args(run_dir, *BASE, f"train.max_steps={max_steps}"))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    return result.out + result.err


def _steps(lora: Path) -> list[str]:
    return sorted(p.name for p in lora.iterdir() if p.is_dir())


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def _differ(a: Path, b: Path) -> bool:
    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys()
    return any(not torch.equal(ta[k], tb[k]) for k in ta)


def test_step_exports_pruned_kept_and_resumed(tmp_path):
    run = tmp_path / "run"
    lora = run / "lora"

    _train(run, 5)  # step exports at 2 and 4 (keep 1); the final one at 5
    assert _steps(lora) == ["step_4"]
    final = _files(lora)
    assert WEIGHTS in final
    assert final <= _files(lora / "step_4")  # every format the final export writes
    assert _differ(lora / "step_4" / WEIGHTS, lora / WEIGHTS)  # steps 4 -> 5 trained
    first_final = load_file(lora / WEIGHTS)

    assert "resumed from" in _train(run, 7)  # resumes at step 5: a step export at 6 prunes step_4; the final one at 7
    assert _steps(lora) == ["step_6"]
    assert final <= _files(lora / "step_6")
    assert _differ(lora / "step_6" / WEIGHTS, lora / WEIGHTS)
    assert any(not torch.equal(first_final[k], v) for k, v in load_file(lora / WEIGHTS).items())
    assert not [p.name for p in run.iterdir() if p.name.startswith(".lora")]  # no temporaries
