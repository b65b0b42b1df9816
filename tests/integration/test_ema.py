"""`train.ema`: a 2-stage tiny Flux LoRA keeps an EMA of its adapters, samples with it
(`sample.ema=true`), saves it in each checkpoint and exports it to `lora/ema/` and
`lora/step_<N>/ema/`. A copy of the run cut back to its step-2 checkpoint (as a kill just after
it leaves it) resumes to the same EMA; a copy resumed with `train.ema.decay=0` drops it and
trains exactly the same weights (swapping the EMA in and out never changes the training).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import dpipe_command, dpipe_train, metrics, train_args
from tests.integration.sampled import diffusers_latents, saved_latents

pytestmark = pytest.mark.slow

RUN = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=2", "pipeline.micro_batches=2",
       "optim.lr=1e-3", "train.max_steps=4", "train.checkpoint_every_steps=2",
       "train.export_every_steps=2", "train.ema.decay=0.5", "sample.prompts=[a red circle]",
       "sample.steps=2", "sample.save_latents=true", "sample.ema=true"]
LORA = "pytorch_lora_weights.safetensors"
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # 2 gloo stages against diffusers in one process


def _train(run_dir: Path, *overrides: str) -> str:
    result = dpipe_train(*train_args(run_dir, *RUN, *overrides))
    assert result.code == 0, result.out + result.err[-4000:]
    return result.err


def _cut_back_to_step_2(source: Path, copy: Path) -> Path:
    shutil.copytree(source, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000004")
    shutil.rmtree(copy / "lora")  # the step-2 export too: the resume writes it again
    shutil.rmtree(copy / "samples" / "step_4")
    return copy


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ema")
    straight = root / "straight"
    _train(straight)
    resumed = _cut_back_to_step_2(straight, root / "resumed")
    assert "resumed from" in _train(resumed)
    dropped = _cut_back_to_step_2(straight, root / "dropped")
    assert "resumed from" in _train(dropped, "train.ema.decay=0", "sample.ema=false")
    return {"straight": straight, "resumed": resumed, "dropped": dropped}


def test_each_stage_checkpoints_its_ema_and_the_manifest_lists_it(runs):
    import json

    for step in (2, 4):
        folder = runs["straight"] / "checkpoints" / f"step_{step:08d}"
        files = json.loads((folder / "COMPLETE").read_text())["files"]
        for stage in (0, 1):
            assert f"ema-stage-{stage:03d}.safetensors" in files, (step, sorted(files))
    assert not any("ema" in name for name in json.loads(
        (runs["dropped"] / "checkpoints" / "step_00000004" / "COMPLETE").read_text())["files"])


def test_the_ema_export_sits_beside_the_weights_and_differs_from_them(runs):
    lora = runs["straight"] / "lora"
    assert sorted(p.name for p in lora.iterdir() if p.is_dir()) == ["ema", "step_2"]
    assert (lora / "step_2" / "ema" / LORA).is_file()
    assert sorted(p.name for p in (lora / "ema").iterdir()) == \
        sorted(p.name for p in lora.iterdir() if p.is_file())  # the same formats
    weights, average = load_file(lora / LORA), load_file(lora / "ema" / LORA)
    assert weights.keys() == average.keys()
    b = [k for k in weights if "lora_B" in k]
    assert b and all(average[k].abs().sum() > 0 for k in b)  # it moved from the zero init...
    assert any((weights[k] - average[k]).abs().max() > 1e-4 for k in b)  # ...and lags behind


def test_a_resume_from_the_step_2_checkpoint_gives_the_same_ema(runs):
    for sub in ("ema", "step_2/ema", "."):
        straight = load_file(runs["straight"] / "lora" / sub / LORA)
        resumed = load_file(runs["resumed"] / "lora" / sub / LORA)
        for key, tensor in straight.items():
            assert torch.equal(tensor, resumed[key]), (sub, key)
    assert torch.equal(saved_latents(runs["resumed"] / "samples" / "step_4", 0),
                       saved_latents(runs["straight"] / "samples" / "step_4", 0))


def test_dropping_the_ema_on_resume_trains_the_same_weights(runs):
    dropped = runs["dropped"]
    assert not (dropped / "lora" / "ema").exists()
    assert not (dropped / "lora" / "step_2" / "ema").exists()
    straight = {m["step"]: m["loss"] for m in metrics(runs["straight"])}
    assert all(straight[m["step"]] == m["loss"] for m in metrics(dropped) if m["step"] > 2)
    weights, again = load_file(runs["straight"] / "lora" / LORA), load_file(dropped / "lora" / LORA)
    for key, tensor in weights.items():
        assert torch.equal(tensor, again[key]), key


def test_samples_are_the_ema_exports_as_the_diffusers_pipeline_loads_it(runs):
    run_dir = runs["straight"]
    ema, = diffusers_latents(run_dir, run_dir / "lora" / "ema")  # FluxPipeline.load_lora_weights
    plain, = diffusers_latents(run_dir, run_dir / "lora")
    got = saved_latents(run_dir / "samples" / "step_4", 0)
    torch.testing.assert_close(got, ema, **TOLERANCE)
    assert (got - plain).abs().max() > 100 * TOLERANCE["atol"]  # not the plain weights'
    # The dropped run sampled its last step with the weights themselves.
    torch.testing.assert_close(saved_latents(runs["dropped"] / "samples" / "step_4", 0), plain,
                               **TOLERANCE)


def test_dpipe_sample_samples_the_ema_export_of_a_run(runs):
    run_dir = runs["straight"]
    done = dpipe_command("dpipe-sample", f"run={run_dir}", "sample.ema=true")
    assert done.code == 0, done.out + done.err
    torch.testing.assert_close(saved_latents(run_dir / "samples" / "sampled-final-ema", 0),
                               saved_latents(run_dir / "samples" / "step_4", 0), **TOLERANCE)
