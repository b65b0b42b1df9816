"""Edit training end to end, for the edit families (FLUX.1 Kontext, FLUX.2, Qwen-Image-Edit): a
folder dataset with same-stem reference images in `control/`, cached by the real data pipeline
and delivered with each sample, trained in 2 pipeline stages over 2 processes. Qwen-Image-Edit's
text entries are its instructions encoded with their control images by the Qwen2.5-VL encoder.

Checks: the micro-batches carry the reference tokens; the 2-stage first loss equals the 1-stage
loss of the same micro-batches; the exported LoRA, loaded with the family's diffusers pipeline,
reproduces the trained model on an edit batch.

(Qwen-Image-Edit is not in test_families.py: that harness trains on dataset=synthetic, which has
no control images, and the family refuses to train without them.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpipe.models.attention_mask import has_padding
from tests.cli import Sweep, dpipe_train, metrics, train_args
from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers

EDIT_FAMILIES = ["tiny_flux_kontext", "tiny_flux2", "tiny_qwen_image_edit"]


def _assert_reference_tokens(spec, inputs, labels) -> None:
    target = labels[0].shape[1]
    if spec.family == "qwen_image_edit":  # the reference's tokens are an input of their own
        assert inputs[0].shape[1] == target and inputs[5].shape == inputs[0].shape
        # ... and the instruction's embedding holds the control image's vision tokens.
        # ~1300 vision tokens at ~1024x1024. The text is cut after the longest prompt, and its
        # mask is empty when no padding is left (dpipe.models.attention_mask).
        text, mask = inputs[2], inputs[3]
        real = mask.sum(1) if has_padding(mask) else torch.full(text.shape[:1], text.shape[1])
        assert int(real.min()) > 1000
    else:  # FLUX: appended after the target's, twice the target's count
        assert inputs[0].shape[1] == 2 * target


def _edit_dataset(folder: Path, count: int = 4) -> Path:
    """Targets: shapes; references: the same shapes mirrored (the "edit" is the mirroring)."""
    from dpipe.data.synthetic import draw_shape

    (folder / "control").mkdir(parents=True)
    for i in range(count):
        image, caption = draw_shape(i, 64, seed=7)
        image.save(folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text(f"mirror it: {caption}\n")
        image.transpose(0).save(folder / "control" / f"{i:03d}.png")  # FLIP_LEFT_RIGHT
    return folder


def _edit_run_overrides(data: Path) -> list[str]:
    return ["dataset=folder", f"dataset.path={data}", "dataset.control_dir=control",
            "dataset.resolutions=[64]", "pipeline.stages=2", "pipeline.micro_batches=2",
            "optim.lr=1e-3", "train.checkpoint_every_steps=0"]


@pytest.fixture(scope="module")
def edit_sweep(tmp_path_factory) -> Sweep:
    """The three families' LoRA runs (2 steps), one sweep on one edit dataset."""
    base = tmp_path_factory.mktemp("edit")
    data = _edit_dataset(base / "data")
    # Each run ends by sampling an edit of a reference image through its 2 stages.
    prompts = f"sample.prompts=[{{prompt: 'mirror it: a star', control: {data}/control/001.png}}]"
    return Sweep(base / "sweep", f"model={','.join(EDIT_FAMILIES)}",
                 *_edit_run_overrides(data), "train.max_steps=2", prompts, "sample.steps=2",
                 "sample.save_latents=true", "sample.at_start=true")


@pytest.fixture(params=EDIT_FAMILIES)
def edit_run(request, edit_sweep) -> Path:
    return edit_sweep.run_dir(f"model={request.param}")


@pytest.mark.slow
def test_two_stage_edit_loss_equals_one_stage_loss(edit_run):
    from dpipe.data.batches import step_micro_batches
    from dpipe.models.registry import build_spec
    from dpipe.train.trainable import trainable_layers

    run = run_config(edit_run)
    spec = build_spec(run.model)
    layers = trainable_layers(spec, run)
    dataset, plan = cached_dataset(edit_run)
    losses = []
    with torch.no_grad():
        for inputs, labels in step_micro_batches(spec, dataset, plan, run.train.timesteps,
                                                 run.train.seed, 0, 0):
            _assert_reference_tokens(spec, inputs, labels)
            losses.append(spec.loss(run_layers(layers, inputs), labels))
    assert metrics(edit_run)[0]["loss"] == pytest.approx(torch.stack(losses).mean().item(),
                                                         rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_exported_edit_lora_reproduces_the_trained_model(edit_run):
    from dpipe.data.batches import step_micro_batches

    spec, layers = trained_layers(edit_run)
    dataset, plan = cached_dataset(edit_run)
    inputs, labels = next(step_micro_batches(spec, dataset, plan,
                                             run_config(edit_run).train.timesteps, 1, 0, 0))
    _assert_reference_tokens(spec, inputs, labels)
    trained = run_layers(layers, inputs)
    with torch.no_grad():
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
        with_lora = spec.denoiser_forward(spec.load_denoiser_with_lora(edit_run / "lora"), inputs)
    assert (with_lora - base).abs().max() > 1e-5, "training left the LoRA without effect"
    torch.testing.assert_close(with_lora, trained, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_staged_edit_samples_equal_the_diffusers_pipeline(edit_run):
    """The edit sampled at the end of the run equals the family's diffusers edit pipeline's
    from the exported LoRA, the same reference image, prompt, seed and steps."""
    from tests.integration.sampled import diffusers_latents, saved_latents

    expected = diffusers_latents(edit_run, edit_run / "lora")
    got = saved_latents(edit_run / "samples" / "step_2", 0)
    torch.testing.assert_close(got, expected[0], rtol=1e-4, atol=1e-5)
    before = saved_latents(edit_run / "samples" / "step_0", 0)  # the base model's
    assert (got - before).abs().max() > 1e-4, "training left the sample unchanged"


@pytest.mark.slow
def test_full_edit_fine_tune_exports_a_loadable_model(tmp_path):
    """Qwen-Image-Edit only (test_families.py runs the FLUX edit families' full fine-tunes on
    images alone): a 2-stage full fine-tune on edit pairs, exported, loaded with
    `from_pretrained`, reproduces the trained layers on an edit batch."""
    from dpipe.data.batches import step_micro_batches

    run_dir = tmp_path / "run"
    result = dpipe_train(*train_args(run_dir, "model=tiny_qwen_image_edit",
                                     *_edit_run_overrides(_edit_dataset(tmp_path / "data")),
                                     "train.max_steps=1", "model.mode=full"))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    spec, layers = trained_layers(run_dir)
    dataset, plan = cached_dataset(run_dir)
    inputs, labels = next(step_micro_batches(spec, dataset, plan,
                                             run_config(run_dir).train.timesteps, 0, 0, 0))
    _assert_reference_tokens(spec, inputs, labels)
    denoiser = spec.load_exported_full(run_dir / "model")
    with torch.no_grad():
        expected = spec.denoiser_forward(denoiser, inputs)
    torch.testing.assert_close(run_layers(layers, inputs), expected, rtol=1e-5, atol=1e-6)
    base = spec.load_denoiser(torch.float32)
    changed = sum(not torch.equal(p, q) for p, q in zip(base.parameters(), denoiser.parameters()))
    assert changed > 10, "a full fine-tune should update weights throughout the model"
