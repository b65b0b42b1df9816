"""Samples through `dpipe-train` and `dpipe-sample`: real processes, the pipeline's real stages.

One 2-stage run samples before training and every 2 steps, exports every 2 steps, and is killed
(SIGKILL, the whole process tree) once its step-4 checkpoint is complete, then resumed. Its
samples must equal FluxPipeline's from the exports of the same steps, every round's files must
be there once, and `dpipe-sample` must give the same samples from the run dir, a step export,
and the base model with the LoRA file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.cli import dpipe_command, dpipe_train, train_args, train_killed_at
from tests.integration.sampled import diffusers_latents, requests_of, saved_latents

pytestmark = pytest.mark.slow

PROMPTS = "sample.prompts=[a red circle on a blue background, {prompt: a green square, seed: 7, width: 48, height: 32}]"
RUN = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=2", "optim.lr=1e-3",
       PROMPTS, "sample.every_steps=2", "sample.at_start=true", "sample.steps=3",
       "sample.save_latents=true", "train.max_steps=6", "train.checkpoint_every_steps=2",
       "train.export_every_steps=2"]
ROUNDS = [0, 2, 4, 6]
# fp32 over 2 gloo stages against diffusers in one process: the same operations, in another
# order where the stages split them.
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The run, killed after its step-4 checkpoint and resumed to the end."""
    run_dir = tmp_path_factory.mktemp("samples") / "run"
    train_killed_at(run_dir, "checkpoints/step_00000004/COMPLETE", *RUN)
    assert not (run_dir / "lora" / "pytorch_lora_weights.safetensors").exists()
    result = dpipe_train(*train_args(run_dir, *RUN))
    assert result.code == 0, result.out + result.err
    assert "resumed from" in result.err
    return run_dir


def test_every_round_is_written_once(run_dir):
    samples = run_dir / "samples"
    rounds = sorted(p.name for p in samples.iterdir() if p.is_dir())
    assert rounds == sorted(f"step_{n}" for n in ROUNDS)
    for n in ROUNDS:
        names = sorted(p.name for p in (samples / f"step_{n}").iterdir())
        assert names == ["0.png", "0.safetensors", "1.png", "1.safetensors", "prompts.json"], \
            (n, names)
    from PIL import Image

    assert Image.open(samples / "step_6" / "1.png").size == (48, 32)
    page = (samples / "index.html").read_text()
    for n in ROUNDS:
        assert f"<th>step_{n}</th>" in page
        for k in (0, 1):
            assert f'src="step_{n}/{k}.png"' in page
    assert "a red circle on a blue background" in page and "a green square" in page
    # Each round's latents are its own: training moved the LoRA between them.
    first, last = saved_latents(samples / "step_0", 0), saved_latents(samples / "step_6", 0)
    assert (first - last).abs().max() > 1e-3


def test_tensorboard_has_each_round_once(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    for k in (0, 1):
        steps = [e.step for e in events.Images(f"samples/{k}")]
        assert steps == ROUNDS, (k, steps)


def test_samples_equal_the_diffusers_pipeline_from_the_same_steps_exports(run_dir):
    base = diffusers_latents(run_dir, None)
    for n in (0, 4, 6):
        weights = {0: None, 4: run_dir / "lora" / "step_4", 6: run_dir / "lora"}[n]
        expected = base if weights is None else diffusers_latents(run_dir, weights)
        for k, latents in enumerate(expected):
            got = saved_latents(run_dir / "samples" / f"step_{n}", k)
            torch.testing.assert_close(got, latents, **TOLERANCE, msg=f"step {n}, sample {k}")
            if n:  # the trained LoRA changes the sample far beyond the tolerance
                assert (latents - base[k]).abs().max() > 100 * TOLERANCE["atol"]


def test_the_png_is_the_decoded_latents(run_dir):
    from PIL import Image

    from dpipe.sample.outputs import to_uint8

    _, spec, requests = requests_of(run_dir)
    sampling = spec.sampling()
    vae = sampling.load_vae(torch.device("cpu"), torch.float32)
    folder = run_dir / "samples" / "step_6"
    for r in requests:
        pixels = to_uint8(sampling.decode(vae, saved_latents(folder, r.index)))
        png = torch.from_numpy(__import__("numpy").array(Image.open(folder / f"{r.index}.png")))
        assert torch.equal(png.permute(2, 0, 1), pixels)


def _sample(*args: str) -> str:
    done = dpipe_command("dpipe-sample", *args)
    assert done.code == 0, done.out + done.err
    return done.out + done.err


def test_dpipe_sample_from_a_step_export_over_two_stages(run_dir):
    out = _sample(f"run={run_dir}", "export=step_4", "pipeline.stages=2", "name=again")
    assert "on 2 stage(s)" in out
    for k in (0, 1):
        torch.testing.assert_close(saved_latents(run_dir / "samples" / "again", k),
                                   saved_latents(run_dir / "samples" / "step_4", k), **TOLERANCE)
    assert (run_dir / "samples" / "again" / "index.html").is_file()


def test_dpipe_sample_from_the_base_model_and_a_lora_file(run_dir, tmp_path):
    lora = run_dir / "lora" / "pytorch_lora_weights.safetensors"
    _sample("model=tiny_flux", f"lora={lora}", PROMPTS, "sample.steps=3",
            "sample.save_latents=true", "sample.width=64", "sample.height=64", f"out={tmp_path}")
    # The first prompt's size came from the run's dataset (64 x 64): the same sample.
    torch.testing.assert_close(saved_latents(tmp_path / "pytorch_lora_weights", 0),
                               saved_latents(run_dir / "samples" / "step_6", 0), **TOLERANCE)


@pytest.mark.parametrize("args, message", [
    (["run=/nonexistent/run", "sample.prompts=[a]"], "holds no run"),
    (["model=tiny_flux", "lora=/nonexistent.safetensors", "sample.prompts=[a]"], "no such file"),
    (["model=tiny_flux", "sample.prompts=[{prompt: a, frames: 5}]"], "makes images"),
    (["model=tiny_flux", "sample.prompts=[{prompt: a, control: /no/such.png}]"], "no such image"),
    (["model=tiny_flux", "sample.prompts=[{text: a}]"], "unknown key(s) text"),
    (["model=tiny_flux", "sample.prompts=[{prompt: a, width: 50}]"], "multiples of 8"),
])
def test_bad_sample_arguments_are_named_before_any_worker(args, message, tmp_path):
    from dpipe.cli.sample import plan_job
    from dpipe.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_job([*args, f"out={tmp_path}"] if args[0].startswith("model") else args)


def test_dpipe_sample_names_the_exports_a_run_has(run_dir):
    from dpipe.cli.sample import plan_job
    from dpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="The run has: final, step_2, step_4"):
        plan_job([f"run={run_dir}", "export=step_5"])


def test_data_parallel_replicas_share_the_prompts(tmp_path):
    """2 stages x 2 data-parallel replicas: each replica samples its share of 3 prompts, rank 0
    writes them all, and they equal dpipe-sample's in one process from the same export."""
    run_dir = tmp_path / "run"
    result = dpipe_train(*train_args(
        run_dir, "model=tiny_flux", "dataset=synthetic", "pipeline.stages=2",
        "pipeline.data_parallel=2", "train.max_steps=1", "optim.lr=1e-3", "sample.steps=2",
        "sample.save_latents=true", "sample.prompts=[a cat, a dog, {prompt: a cow, seed: 4}]"))
    assert result.code == 0, result.out + result.err
    _sample(f"run={run_dir}", "name=one")
    for k in range(3):
        torch.testing.assert_close(saved_latents(run_dir / "samples" / "one", k),
                                   saved_latents(run_dir / "samples" / "step_1", k), **TOLERANCE)
