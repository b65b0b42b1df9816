"""Every model family, on its tiny flavor, through the same checks.

1. Its pipeline layers, run one after another, reproduce the family's own diffusers forward.
2. A 2-stage LoRA run in 2 processes: its first loss equals the 1-stage loss of the same
   micro-batches; its exported LoRA, loaded the way users load it, reproduces the trained model.
3. A 2-stage full fine-tune: the exported model loads with `from_pretrained` and reproduces it.

Add a family by adding its tiny config name to FAMILIES.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cli import dpipe_train, metrics, train_args
from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers

FAMILIES = ["tiny_flux", "tiny_hunyuan_video", "tiny_ltx_video", "tiny_hunyuan_video15", "tiny_ltx2", "tiny_auraflow", "tiny_sdxl", "tiny_hunyuan_image", "tiny_hidream", "tiny_sd3", "tiny_chroma", "tiny_z_image",
            "tiny_wan", "tiny_wan_i2v", "tiny_wan22_ti2v", "tiny_wan22_a14b",
            "tiny_cosmos_predict2", "tiny_cosmos_predict2_v2w", "tiny_lumina2", "tiny_flux2", "tiny_flux_kontext", "tiny_qwen_image"]


def _run(run_dir: Path, model: str, *overrides: str) -> Path:
    result = dpipe_train(*train_args(
        run_dir, f"model={model}", "dataset=synthetic", "pipeline.stages=2",
        "pipeline.micro_batches=2", "optim.lr=1e-3", "train.checkpoint_every_steps=0",
        *overrides,
    ))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    return run_dir


@pytest.fixture(scope="module", params=FAMILIES)
def lora_run(request, tmp_path_factory) -> Path:
    return _run(tmp_path_factory.mktemp(request.param) / "lora", request.param,
                "train.max_steps=2")


@pytest.mark.slow
@pytest.mark.parametrize("model", FAMILIES)
def test_layers_reproduce_the_denoiser(model, tmp_path):
    run_dir = _run(tmp_path / "run", model, "train.max_steps=1", "model.mode=full")
    spec, layers = trained_layers(run_dir)
    dataset, plan = cached_dataset(run_dir)
    from dpipe.data.batches import step_micro_batches

    inputs, _ = next(step_micro_batches(spec, dataset, plan, run_config(run_dir).train.timesteps,
                                        0, 0, 0))
    denoiser = spec.load_exported_full(run_dir / "model")
    with torch.no_grad():
        expected = spec.denoiser_forward(denoiser, inputs)
    torch.testing.assert_close(run_layers(layers, inputs), expected, rtol=1e-5, atol=1e-6)
    base = spec.load_denoiser(torch.float32)
    changed = sum(not torch.equal(p, q) for p, q in zip(base.parameters(), denoiser.parameters()))
    assert changed > 10, "a full fine-tune should update weights throughout the model"


@pytest.mark.slow
def test_two_stage_loss_equals_one_stage_loss(lora_run):
    from dpipe.data.batches import step_micro_batches
    from dpipe.models.registry import build_spec
    from dpipe.train.trainable import trainable_layers

    run = run_config(lora_run)
    spec = build_spec(run.model)
    layers = trainable_layers(spec, run)  # the initial weights, as every rank builds them
    dataset, plan = cached_dataset(lora_run)
    losses = []
    with torch.no_grad():
        for inputs, labels in step_micro_batches(spec, dataset, plan, run.train.timesteps,
                                                 run.train.seed, 0, 0):
            losses.append(spec.loss(run_layers(layers, inputs), labels))
    one_stage = torch.stack(losses).mean().item()
    two_stage = metrics(lora_run)[0]["loss"]
    assert two_stage == pytest.approx(one_stage, rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_exported_lora_reproduces_the_trained_model(lora_run):
    spec, layers = trained_layers(lora_run)
    dataset, plan = cached_dataset(lora_run)
    from dpipe.data.batches import step_micro_batches

    inputs, _ = next(step_micro_batches(spec, dataset, plan,
                                        run_config(lora_run).train.timesteps, 1, 0, 0))
    trained = run_layers(layers, inputs)
    with torch.no_grad():
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
        with_lora = spec.denoiser_forward(spec.load_denoiser_with_lora(lora_run / "lora"), inputs)
    assert (with_lora - base).abs().max() > 1e-5, "training left the LoRA without effect"
    torch.testing.assert_close(with_lora, trained, rtol=1e-4, atol=1e-5)
