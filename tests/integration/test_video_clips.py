"""Video families on a real mixed dataset: clips (decoded with PyAV, put in frame buckets) and
images in one run, 2 pipeline stages, LoRA exported and reloaded.

The generic harness (test_families.py) trains every family on images; this adds what only video
families do: clips whose frame count the family's VAE takes (4k+1 for HunyuanVideo, ...) in the
same run as 1-frame images.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dpipe.data.conditioning import draw_mode
from dpipe.models.frame_modes import FRAME_MODES
from dpipe.models.sync_free import sizes
from tests.cli import Sweep, metrics
from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers

# Sweeps of the families that train with the same overrides: a clip length (frame bucket) their
# VAE takes, and extra overrides. LTX-Video and Wan 2.2 TI2V train image-to-video here (first-frame
# conditioning on the clips; images stay text-to-image).
SWEEPS = [
    # HunyuanVideo (1.5), Wan: i2v conditioning (CLIP tokens + first-frame latents);
    # Cosmos-Predict2 Video2World: first latent frame given, condition-mask channel. The 9-frame
    # clips are cut to 5.
    (5, (), ["tiny_hunyuan_video", "tiny_hunyuan_video15", "tiny_wan", "tiny_wan_i2v",
             "tiny_cosmos_predict2_v2w"]),
    # Wan 2.2 I2V-A14B's low-noise expert on its t range, each sample given its first frame or
    # its first and last frames; sampled from a first and a last frame at the end.
    (5, ("dataset.conditioning.first=0.5", "dataset.conditioning.both=0.5",
         "sample.prompts=[{prompt: a red square, first_frame: {folder}/image0.png, "
         "last_frame: {folder}/image1.png, frames: 5}]", "sample.steps=2",
         "sample.save_latents=true"), ["tiny_wan22_i2v_a14b"]),
    (9, ("model.i2v=true",), ["tiny_ltx_video", "tiny_wan22_ti2v"]),
    (9, (), ["tiny_ltx2"]),  # LTX-2: the video stream
]
FRAMES = {model: frames for frames, _, models in SWEEPS for model in models}


def _write_clip(path: Path, frames: int, seed: int, size: int = 64) -> None:
    """A square moving across a coloured background: frames differ, as in real clips."""
    import av

    rng = np.random.default_rng(seed)
    back, fore = rng.integers(0, 255, 3), rng.integers(0, 255, 3)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            image = np.empty((size, size, 3), np.uint8)
            image[:] = back
            x = 4 + 4 * i
            image[20:40, x:x + 20] = fore
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("mixed")
    for i in range(3):
        _write_clip(folder / f"clip{i}.mp4", frames=9, seed=i)
        (folder / f"clip{i}.txt").write_text(f"a red square moving right, clip {i}")
        pixels = np.random.default_rng(10 + i).integers(0, 255, (64, 64, 3), np.uint8)
        Image.fromarray(pixels).save(folder / f"image{i}.png")
        (folder / f"image{i}.txt").write_text("a blue circle on a green background")
    return folder


@pytest.fixture(scope="module")
def runs(mixed_folder, tmp_path_factory) -> dict[str, Sweep]:
    """The sweep holding each family's 2-stage LoRA run on the mixed folder (3 steps), by model."""
    runs = {}
    for i, (frames, extra, models) in enumerate(SWEEPS):
        sweep = Sweep(tmp_path_factory.mktemp(f"sweep{i}"), f"model={','.join(models)}",
                      "dataset=folder", f"dataset.path={mixed_folder}", "dataset.resolutions=[64]",
                      f"dataset.frame_buckets=[1,{frames}]", "pipeline.stages=2",
                      "pipeline.micro_batches=2", "optim.lr=1e-3", "train.checkpoint_every_steps=0",
                      "train.max_steps=3", "train.progress_bar=false",
                      *(e.replace("{folder}", str(mixed_folder)) for e in extra))
        runs.update({model: sweep for model in models})
    return runs


def _micro_batches(spec, run, dataset, plan, step):
    from dpipe.data.batches import step_micro_batches

    return list(step_micro_batches(spec, dataset, plan, run.train.timesteps, run.train.seed,
                                   step, 0))


def _frame_modes(spec, run, dataset, plan, step: int) -> list[str]:
    """The frame modes the samples of a step trained with (Wan I2V-A14B), read from the model's
    inputs where they show (the mask's last pixel frame, on clips) and checked against the
    draw there."""
    modes = []
    z = spec.variant.z_dim
    for micro, (inputs, _) in enumerate(_micro_batches(spec, run, dataset, plan, step)):
        slots = plan.micro_batch(step, micro, 0).slots
        drawn = [FRAME_MODES[draw_mode(dataset.frame_probabilities, run.train.seed, step, slot)]
                 for slot in slots]
        if inputs[0].shape[2] > 1:
            shown = ["both" if m else "first" for m in inputs[0][:, z + 3, -1, 0, 0].tolist()]
            assert shown == drawn
        modes += drawn
    return modes


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(FRAMES))
def test_clips_and_images_train_in_one_run(model, runs):
    from dpipe.models.registry import build_spec
    from dpipe.train.trainable import trainable_layers

    frames = FRAMES[model]
    run_dir = runs[model].run_dir(f"model={model}")
    run = run_config(run_dir)
    spec = build_spec(run.model)
    dataset, plan = cached_dataset(run_dir)

    # 9-frame clips go to the `frames` bucket, images to the 1-frame one; both are trained.
    buckets = {(step, micro): plan.micro_batch(step, micro, 0).bucket.frames
               for step in range(plan.steps_per_epoch) for micro in range(plan.micro_batches)}
    assert set(buckets.values()) == {1, frames}

    # The 2-stage run's first loss is the 1-stage loss of the same micro-batches.
    layers = trainable_layers(spec, run)
    with torch.no_grad():
        losses = [spec.loss(run_layers(layers, inputs), labels)
                  for inputs, labels in _micro_batches(spec, run, dataset, plan, 0)]
    assert metrics(run_dir)[0]["loss"] == pytest.approx(torch.stack(losses).mean().item(),
                                                        rel=1e-5, abs=1e-7)

    if model == "tiny_wan22_i2v_a14b":  # the report counts the frame modes the batches took
        drawn = Counter(m for step in range(run.train.max_steps)
                        for m in _frame_modes(spec, run, dataset, plan, step))
        assert set(drawn) == {"first", "both"}
        report = (run_dir / "data" / "report-train.txt").read_text()
        assert (f"conditioning: of the 6 samples of the run's 3 steps, first {drawn['first']} "
                f"({drawn['first'] / 6:.1%}), both {drawn['both']} ({drawn['both'] / 6:.1%}) "
                "(dataset.conditioning: first=0.5, both=0.5)") in report
        # The staged sample from a first and a last frame is WanImageToVideoPipeline's with
        # `last_image` (the frozen high-noise expert takes the first step).
        from tests.integration.sampled import diffusers_latents, saved_latents

        expected = diffusers_latents(run_dir, run_dir / "lora")[0]
        torch.testing.assert_close(saved_latents(run_dir / "samples" / "step_3", 0), expected,
                                   rtol=1e-4, atol=1e-5)

    # The exported LoRA, loaded as users load it, reproduces the trained model on a clip.
    spec, trained = trained_layers(run_dir)
    step, micro = next(k for k, f in buckets.items() if f == frames)
    clip_inputs, _ = _micro_batches(spec, run, dataset, plan, step)[micro]
    if spec.family in ("ltx_video", "ltx2"):  # the rope takes the clips' own rate (8 fps)
        assert set(sizes(clip_inputs[5])) == {8000}
    with torch.no_grad():
        want = run_layers(trained, clip_inputs)
        got = spec.denoiser_forward(spec.load_denoiser_with_lora(run_dir / "lora"), clip_inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
