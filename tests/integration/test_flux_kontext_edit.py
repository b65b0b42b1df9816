"""Edit training end to end, for the edit families (FLUX.1 Kontext, Qwen-Image-Edit with one
reference; FLUX.2 and Qwen-Image-Edit-2511 with two): a folder dataset with same-stem reference
images in `control/` (`000.png`, or `000_1.png` and `000_2.png`), cached by the real data pipeline
and delivered with each sample, trained in 2 pipeline stages over 2 processes. The Qwen edits'
text entries are their instructions encoded with their control images by the Qwen2.5-VL encoder.

Checks: the micro-batches carry the reference tokens; the 2-stage first loss equals the 1-stage
loss of the same micro-batches; the exported LoRA, loaded with the family's diffusers pipeline,
reproduces the trained model on an edit batch; the one-reference runs' staged samples equal the
pipelines' (the two-reference samplers: their unit tests).

(The Qwen edits are not in test_families.py: that harness trains on dataset=synthetic, which has
no control images, and they refuse to train without them.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpipe.models.attention_mask import has_padding
from tests.cli import Sweep, dpipe_train, metrics, train_args
from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers

# By how many references each sample of their dataset has.
ONE_REFERENCE = ["tiny_flux_kontext", "tiny_qwen_image_edit"]
TWO_REFERENCES = ["tiny_flux2", "tiny_qwen_image_edit_plus"]
EDIT_FAMILIES = ONE_REFERENCE + TWO_REFERENCES


def _assert_reference_tokens(spec, inputs, labels) -> None:
    target = labels[0].shape[1]
    references = 1 if spec.family in ("flux_kontext", "qwen_image_edit") else 2
    if spec.family.startswith("qwen_image_edit"):  # the references' tokens: an input of their own
        assert inputs[0].shape[1] == target and inputs[5].shape[1] == references * target
        # ... and the instruction's embedding holds the control images' vision tokens: ~1300
        # at ~1024x1024 (Edit), ~190 each at ~384x384 (Edit-2511). The text is cut after the
        # longest prompt, and its mask is empty when no padding is left
        # (dpipe.models.attention_mask).
        text, mask = inputs[2], inputs[3]
        real = mask.sum(1) if has_padding(mask) else torch.full(text.shape[:1], text.shape[1])
        assert int(real.min()) > (1000 if references == 1 else 2 * 140)
    else:  # FLUX: appended after the target's, each as many as the target's
        assert inputs[0].shape[1] == (1 + references) * target


def _edit_dataset(folder: Path, count: int = 4, references: int = 1) -> Path:
    """Targets: shapes; references: the same shapes mirrored (the "edit" is the mirroring); a
    second reference, where asked, mirrored upside down."""
    from dpipe.data.synthetic import draw_shape

    (folder / "control").mkdir(parents=True)
    for i in range(count):
        image, caption = draw_shape(i, 64, seed=7)
        image.save(folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text(f"mirror it: {caption}\n")
        mirrored = image.transpose(0)  # FLIP_LEFT_RIGHT
        if references == 1:
            mirrored.save(folder / "control" / f"{i:03d}.png")
        else:
            for r in range(references):
                (mirrored if r == 0 else mirrored.transpose(1)).save(
                    folder / "control" / f"{i:03d}_{r + 1}.png")
    return folder


def _edit_run_overrides(data: Path) -> list[str]:
    return ["dataset=folder", f"dataset.path={data}", "dataset.control_dir=control",
            "dataset.resolutions=[64]", "pipeline.stages=2", "pipeline.micro_batches=2",
            "optim.lr=1e-3", "train.checkpoint_every_steps=0"]


def _edit_sweep(base: Path, families: list[str], references: int) -> Sweep:
    data = _edit_dataset(base / "data", references=references)
    samples = []
    if references == 1:
        # Each run ends by sampling an edit of a reference image through its 2 stages. (The
        # two-reference families' samplers are checked against their pipelines in their unit
        # tests: Qwen-Image-Edit-2511's pipeline encodes each reference at ~1 MP, minutes here.)
        samples = [f"sample.prompts=[{{prompt: 'mirror it: a star', "
                   f"control: {data}/control/001.png}}]", "sample.steps=2",
                   "sample.save_latents=true", "sample.at_start=true"]
    return Sweep(base / "sweep", f"model={','.join(families)}",
                 *_edit_run_overrides(data), "train.max_steps=2", *samples)


@pytest.fixture(scope="module")
def edit_sweeps(tmp_path_factory) -> dict[int, Sweep]:
    """The families' LoRA runs (2 steps): one sweep per dataset (one and two references), each
    made when first needed."""
    return {}


def _run_dir(model: str, sweeps: dict[int, Sweep], tmp_path_factory) -> Path:
    references = 1 if model in ONE_REFERENCE else 2
    if references not in sweeps:
        sweeps[references] = _edit_sweep(
            tmp_path_factory.mktemp(f"edit{references}"),
            ONE_REFERENCE if references == 1 else TWO_REFERENCES, references)
    return sweeps[references].run_dir(f"model={model}")


@pytest.fixture(params=EDIT_FAMILIES)
def edit_run(request, edit_sweeps, tmp_path_factory) -> Path:
    return _run_dir(request.param, edit_sweeps, tmp_path_factory)


@pytest.fixture(params=ONE_REFERENCE)
def sampled_edit_run(request, edit_sweeps, tmp_path_factory) -> Path:
    return _run_dir(request.param, edit_sweeps, tmp_path_factory)


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
def test_staged_edit_samples_equal_the_diffusers_pipeline(sampled_edit_run):
    """The edit sampled at the end of the run equals the family's diffusers edit pipeline's
    from the exported LoRA, the same reference image, prompt, seed and steps."""
    from tests.integration.sampled import diffusers_latents, saved_latents

    edit_run = sampled_edit_run
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
