"""A real two-stage run with `train.timesteps.shift=auto`, mode sampling and cosmap weighting:
its first loss is the one-process loss of those choices (each micro-batch shifted by its own
bucket's size, in the loader's worker process too), not the default config's; its evals run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from dpipe.config.schema import TimestepConfig
from tests.cli import dpipe_train, metrics, train_args
from tests.integration.trained import cached_dataset, one_process_first_loss, run_config, run_layers

pytestmark = pytest.mark.slow

CHOICES = ["train.timesteps.shift=auto", "train.timesteps.sampling=mode",
           "train.timesteps.weighting=cosmap"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from PIL import Image

    folder: Path = tmp_path_factory.mktemp("images")
    for i in range(2):
        pixels = np.random.default_rng(i).integers(0, 255, (64, 64, 3), np.uint8)
        Image.fromarray(pixels).save(folder / f"image{i}.png")
        (folder / f"image{i}.txt").write_text(f"picture {i}")
    run_dir = tmp_path_factory.mktemp("run")
    result = dpipe_train(*train_args(
        run_dir, "model=tiny_flux", "dataset=folder", f"dataset.path={folder}",
        "dataset.resolutions=[32,64]", "pipeline.stages=2", "pipeline.data_parallel=1",
        "pipeline.micro_batches=4", "train.max_steps=1", "train.checkpoint_every_steps=0",
        "train.loader_workers=1", "dataset.eval.before_training=true",
        f"dataset.eval.sets=[{{name:holdout,directories:[{{path:'{folder}'}}]}}]", *CHOICES))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    return run_dir


def _first_loss(run_dir: Path, timesteps: TimestepConfig) -> float:
    from dpipe.data.batches import step_micro_batches
    from dpipe.models.registry import build_spec
    from dpipe.train.trainable import trainable_layers

    run = run_config(run_dir)
    spec = build_spec(run.model)
    layers = trainable_layers(spec, run)
    dataset, plan = cached_dataset(run_dir)
    with torch.no_grad():
        losses = [spec.loss(run_layers(layers, inputs), labels) for inputs, labels in
                  step_micro_batches(spec, dataset, plan, timesteps, run.train.seed, 0, 0)]
    return torch.stack(losses).mean().item()


def test_the_run_trains_on_the_chosen_timesteps(run_dir):
    from dpipe.models.registry import build_spec

    run = run_config(run_dir)
    t = run.train.timesteps
    assert t.auto_shift and t.sampling.value == "mode" and t.weighting.value == "cosmap"
    # The two buckets' micro-batches have shifts of their own.
    spec = build_spec(run.model)
    dataset, plan = cached_dataset(run_dir)
    shapes = {tuple(dataset.collate(plan.micro_batch(0, m, 0).samples[:1],
                                    plan.micro_batch(0, m, 0).samples[0].texts[:1])[0].shape[1:])
              for m in range(plan.micro_batches)}
    assert len({spec.training_shift(s) for s in shapes}) == 2, shapes
    first = metrics(run_dir)[0]["loss"]
    assert first == pytest.approx(one_process_first_loss(run_dir), rel=1e-5, abs=1e-7)
    default = _first_loss(run_dir, TimestepConfig())
    assert first != pytest.approx(default, rel=1e-3)
    no_weights = _first_loss(run_dir, dataclasses.replace(t, weighting=TimestepConfig().weighting))
    assert first != pytest.approx(no_weights, rel=1e-3)


def test_evals_run_at_the_auto_shift_of_each_batch(run_dir):
    import json

    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals and all(np.isfinite(v) for e in evals for k, v in e.items() if k != "step")
