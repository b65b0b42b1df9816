"""Families that cut text padding (dpipe.models.attention_mask) send text of a different length
with each micro-batch: across two pipeline stages the run still gives the one-process loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.cli import Sweep, metrics
from tests.integration.trained import cached_dataset, one_process_first_loss, run_config

MODELS = ["tiny_hunyuan_video", "tiny_qwen_image", "tiny_chroma", "tiny_z_image", "tiny_lumina2",
          "tiny_hunyuan_image", "tiny_ltx_video", "tiny_hunyuan_video15"]
CAPTIONS = ["red", "a small blue circle drawn on a bright green background with a thin border",
            "two stars", "an orange triangle on a grey background"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Sweep:
    from PIL import Image

    folder: Path = tmp_path_factory.mktemp("captions")
    for i, caption in enumerate(CAPTIONS):
        pixels = np.random.default_rng(i).integers(0, 255, (64, 64, 3), np.uint8)
        Image.fromarray(pixels).save(folder / f"image{i}.png")
        (folder / f"image{i}.txt").write_text(caption)
    return Sweep(tmp_path_factory.mktemp("sweep"), f"model={','.join(MODELS)}", "dataset=folder",
                 f"dataset.path={folder}", "dataset.resolutions=[64]", "pipeline.stages=2",
                 "pipeline.data_parallel=1", "pipeline.micro_batches=4", "train.max_steps=1",
                 "train.checkpoint_every_steps=0", "train.progress_bar=false")


@pytest.mark.parametrize("model", MODELS)
def test_two_stages_train_prompts_of_different_lengths(sweep, model):
    run_dir = sweep.run_dir(f"model={model}")
    from dpipe.data.batches import step_micro_batches
    from dpipe.models.registry import build_spec

    run = run_config(run_dir)
    spec = build_spec(run.model)
    dataset, plan = cached_dataset(run_dir)
    lengths = {inputs[2].shape[1] for inputs, _ in
               step_micro_batches(spec, dataset, plan, run.train.timesteps, run.train.seed, 0, 0)}
    assert len(lengths) > 1, "the micro-batches' text should differ in length"
    assert metrics(run_dir)[0]["loss"] == pytest.approx(one_process_first_loss(run_dir),
                                                        rel=1e-5, abs=1e-7)
