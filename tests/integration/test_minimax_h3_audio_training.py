"""MiniMax H3 with model.audio=true end to end: 22-frame clips with sound at 24 fps and silent
images in one run, 2 pipeline stages in 2 processes (DeepSpeed's engine over gloo), the LoRA
exported and loaded as users load it.

One run checks: micro-batches with audio rows and without train in it; its first loss equals the
1-stage loss of the same micro-batches (video + audio loss); the exported LoRA reproduces the
trained layers on a clip's joined video and audio prediction, and differs from the base model;
its end-of-run sample through the 2 stages (124 frames with their audio rows) equals the t2va
modular pipeline's on the exported LoRA, and its .mp4 carries the decoded stereo sound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cli import Sweep, metrics
from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers
from tests.unit.test_data_support import write_clips_with_sound

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    folder = write_clips_with_sound(tmp_path_factory.mktemp("clips_with_sound"), 22, 24)
    sweep = Sweep(tmp_path_factory.mktemp("sweep"), "model=tiny_minimax_h3", "model.audio=true",
                  "dataset=folder", f"dataset.path={folder}", "dataset.resolutions=[64]",
                  "dataset.frame_buckets=[1,22]", "dataset.video_fps=24", "pipeline.stages=2",
                  "pipeline.micro_batches=2", "optim.lr=1e-3", "train.checkpoint_every_steps=0",
                  "train.max_steps=2", "train.progress_bar=false", "sample.save_latents=true",
                  "sample.prompts=[{prompt: a grey fade with a tone, frames: 124}]",
                  "sample.steps=2")
    return sweep.run_dir("model=tiny_minimax_h3")


def test_clips_with_sound_and_images_train_as_one_stage_does(run_dir):
    from dpipe.data.batches import step_micro_batches
    from dpipe.models.registry import build_spec
    from dpipe.train.trainable import trainable_layers

    run = run_config(run_dir)
    spec = build_spec(run.model)
    dataset, plan = cached_dataset(run_dir)
    batches = {step: list(step_micro_batches(spec, dataset, plan, run.train.timesteps,
                                             run.train.seed, step, 0))
               for step in range(run.train.max_steps)}
    with_audio = [len(inputs) == 6 for step in batches.values() for inputs, _ in step]
    assert any(with_audio) and not all(with_audio), with_audio  # clips and images
    clip = next(inputs for step in batches.values() for inputs, _ in step if len(inputs) == 6)
    assert clip[1].shape[1] == 2 * round(22 / 24 * 40)  # stereo rows of 37 latents

    layers = trainable_layers(spec, run)
    with torch.no_grad():
        losses = [spec.loss(run_layers(layers, inputs), labels) for inputs, labels in batches[0]]
    assert metrics(run_dir)[0]["loss"] == pytest.approx(torch.stack(losses).mean().item(),
                                                        rel=1e-5, abs=1e-7)

    spec, trained = trained_layers(run_dir)
    with torch.no_grad():
        want = run_layers(trained, clip)
        got = spec.denoiser_forward(spec.load_denoiser_with_lora(run_dir / "lora"), clip)
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), clip)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (got - base).abs().max() > 1e-5


def test_samples_are_the_pipelines(run_dir):
    import av

    from tests.integration.sampled import diffusers_latents, saved_latents

    expected, = diffusers_latents(run_dir, run_dir / "lora")
    torch.testing.assert_close(saved_latents(run_dir / "samples" / "step_2", 0), expected,
                               rtol=1e-4, atol=1e-5)
    with av.open(str(run_dir / "samples" / "step_2" / "0.mp4")) as container:  # with its sound
        track = container.streams.audio[0]
        assert (track.codec_context.name, track.channels) == ("aac", 2)
