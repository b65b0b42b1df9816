"""LTX-2 with model.audio=true end to end: clips with sound and silent images in one run, 2
pipeline stages in 2 processes (DeepSpeed's engine over gloo), the LoRA exported and loaded as
users load it.

One run checks: micro-batches with sound and without train in it (their tuples keep one layout
across stages); its first loss equals the 1-stage loss of the same micro-batches (video +
audio loss); the exported LoRA reproduces the trained layers on both outputs of a clip with
sound, and differs from the base model on both; clips train given their first frame, their last,
both or none (dataset.conditioning 0.25 each); its end-of-run samples through the 2 stages (both
streams, the joint computation), from a prompt and from a first frame, equal LTX2Pipeline's and
LTX2ImageToVideoPipeline's on the exported LoRA, and the .mp4 carries the sound.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from dpipe.data.conditioning import draw_mode
from dpipe.models.frame_modes import FRAME_MODES
from tests.cli import Sweep, metrics
from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers
from tests.unit.test_data_support import write_clips_with_sound

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    # 9 frames at 8 fps with tones on their track; images have no sound.
    folder = write_clips_with_sound(tmp_path_factory.mktemp("clips_with_sound"), 9, 8)
    sweep = Sweep(tmp_path_factory.mktemp("sweep"), "model=tiny_ltx2", "model.audio=true",
                  "dataset=folder", f"dataset.path={folder}", "dataset.resolutions=[64]",
                  "dataset.frame_buckets=[1,9]", "pipeline.stages=2", "pipeline.micro_batches=2",
                  "optim.lr=1e-3", "train.checkpoint_every_steps=0", "train.max_steps=2",
                  "train.progress_bar=false", "sample.save_latents=true",
                  "dataset.conditioning.first=0.25", "dataset.conditioning.last=0.25",
                  "dataset.conditioning.both=0.25", "dataset.conditioning.none=0.25",
                  "sample.prompts=[{prompt: a grey fade with a tone, frames: 9}, "
                  f"{{prompt: a grey fade with a tone, first_frame: {folder}/image0.png, "
                  "frames: 9}]", "sample.steps=2")
    return sweep.run_dir("model=tiny_ltx2")


def _micro_batches(spec, run, dataset, plan, step):
    from dpipe.data.batches import step_micro_batches

    return list(step_micro_batches(spec, dataset, plan, run.train.timesteps, run.train.seed,
                                   step, 0))


def test_clips_with_sound_and_images_train_as_one_stage_does(run_dir):
    from dpipe.models.registry import build_spec
    from dpipe.train.trainable import trainable_layers

    run = run_config(run_dir)
    spec = build_spec(run.model)
    dataset, plan = cached_dataset(run_dir)
    batches = {step: _micro_batches(spec, run, dataset, plan, step)
               for step in range(run.train.max_steps)}  # the steps the run trained
    audio_tokens = [inputs[6].shape[1] for step in batches.values() for inputs, _ in step]
    assert 0 in audio_tokens and max(audio_tokens) > 0, audio_tokens  # silent and with sound
    # dataset.conditioning 0.25 each: each sample's drawn mode shows on a clip (its first
    # frame's tokens at t = 0; its last frame's own 8 x 8 tokens appended, at t = 0), and the
    # dataset report counts the draws.
    drawn, shown = Counter(), Counter()
    for step, micro_batches in batches.items():
        for micro, (inputs, _) in enumerate(micro_batches):
            modes = [FRAME_MODES[draw_mode(dataset.frame_probabilities, run.train.seed, step,
                                           slot)] for slot in plan.micro_batch(step, micro, 0).slots]
            drawn.update(modes)
            if inputs[0].shape[1] > 64:  # a clip: two latent frames of 8 x 8 tokens
                first = [bool((t[:64] == 0).all()) for t in inputs[1]]
                last = inputs[0].shape[1] == 3 * 64 and bool((inputs[1][:, 128:] == 0).all())
                seen = [{(False, False): "none", (True, False): "first", (False, True): "last",
                         (True, True): "both"}[(f, last)] for f in first]
                assert seen == modes
                shown.update(seen)
    assert shown["last"] + shown["both"] > 0, shown  # a last frame reached the layers
    report = (run_dir / "data" / "report-train.txt").read_text()
    counts = ", ".join(f"{m} {drawn[m]} ({drawn[m] / 4:.1%})" for m in FRAME_MODES)
    assert (f"of the 4 samples of the run's 2 steps, {counts} (dataset.conditioning: none=0.25, "
            "first=0.25, last=0.25, both=0.25)") in report

    # The 2-stage run's first loss is the 1-stage loss of the same micro-batches.
    layers = trainable_layers(spec, run)
    with torch.no_grad():
        losses = [spec.loss(run_layers(layers, inputs), labels) for inputs, labels in batches[0]]
    assert metrics(run_dir)[0]["loss"] == pytest.approx(torch.stack(losses).mean().item(),
                                                        rel=1e-5, abs=1e-7)

    # The exported LoRA, loaded as users load it, reproduces both outputs on a clip with sound.
    spec, trained = trained_layers(run_dir)
    clip_inputs = next(inputs for step in batches.values() for inputs, _ in step
                       if inputs[6].shape[1] > 0)
    with torch.no_grad():
        want = run_layers(trained, clip_inputs)
        got = spec.denoiser_forward(spec.load_denoiser_with_lora(run_dir / "lora"), clip_inputs)
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), clip_inputs)
    for stream, (g, w, b) in enumerate(zip(got, want, base)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=f"output {stream}")
        assert (g - b).abs().max() > 1e-5, f"training left output {stream} unchanged"


def test_samples_are_the_pipelines_with_sound(run_dir):
    """The 2-stage sample of both streams (the one tensor the stages carry) equals LTX2Pipeline's
    final latents of both; the written clip has the vocoder's stereo sound."""
    import av

    from tests.integration.sampled import diffusers_latents, saved_latents

    # Text-to-video, and image-to-video from a first frame (LTX2ImageToVideoPipeline's).
    for index, expected in enumerate(diffusers_latents(run_dir, run_dir / "lora")):
        torch.testing.assert_close(saved_latents(run_dir / "samples" / "step_2", index),
                                   expected, rtol=1e-4, atol=1e-5)
    with av.open(str(run_dir / "samples" / "step_2" / "0.mp4")) as container:
        track = container.streams.audio[0]
        assert (track.codec_context.name, track.rate, track.channels) == ("aac", 16000, 2)
