"""Rebuilds a trained model from a run's DeepSpeed checkpoint through dpipe's own code path.

Tests compare it with what the exported files give when loaded by diffusers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from dpipe.config.checks import validate
from dpipe.models.registry import build_spec
from dpipe.pipeline.layer_files import read_layer_state
from dpipe.train.checkpoint import newest_complete
from dpipe.train.lora import make_trainable


def run_config(run_dir: Path):
    return validate(OmegaConf.load(run_dir / "run.yaml"))


def trained_layers(run_dir: Path):
    """The pipeline layers with the newest checkpoint's weights loaded."""
    run = run_config(run_dir)
    spec = build_spec(run.model)
    denoiser = spec.load_denoiser(torch.float32)
    make_trainable(denoiser, run.model, spec.lora_targets())
    layers = spec.pipeline_layers(denoiser)
    _, ckpt = newest_complete(run_dir)
    for i, layer in enumerate(layers):
        state, _ = read_layer_state(ckpt, i)
        missing, unexpected = layer.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
    return spec, layers


def cached_dataset(run_dir: Path):
    """The run's dataset (from its cache) and batch plan, in this process, without DeepSpeed."""
    from dpipe.data.prepare import Layout, prepare

    run = run_config(run_dir)
    spec = build_spec(run.model)
    dataset = prepare(spec, run.dataset, torch.device("cpu"), torch.float32, Layout.of(run, 1))
    return dataset, dataset.plan


def one_process_first_loss(run_dir: Path, model_path: Path | None = None) -> float:
    """The run's first-step loss as its layers give it in this process, with the initial weights
    every rank builds: what the run's metrics must show whatever its stages; with `model_path`,
    what the run would have shown from that model instead."""
    from dpipe.data.batches import step_micro_batches
    from dpipe.train.trainable import trainable_layers

    run = run_config(run_dir)
    if model_path is not None:
        run.model.path = str(model_path)
    spec = build_spec(run.model)
    layers = trainable_layers(spec, run)
    dataset, plan = cached_dataset(run_dir)
    with torch.no_grad():
        losses = [spec.loss(run_layers(layers, inputs), labels) for inputs, labels in
                  step_micro_batches(spec, dataset, plan, run.train.timesteps, run.train.seed, 0, 0)]
    return torch.stack(losses).mean().item()


@torch.no_grad()
def run_layers(layers, inputs):
    x = inputs
    for layer in layers:
        x = layer(x)
    return x


def perturbed(state_dict: dict, scale: float = 0.05, seed: int = 0) -> dict:
    """Someone's fine-tune of a base: every weight moved by a seeded random amount."""
    generator = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=generator, dtype=v.dtype)
            for k, v in state_dict.items()}


def train_lora_from_single_file(run_dir: Path, model: str, file: Path, folder: Path):
    """A 2-stage, 2-step LoRA run of `model` whose transformer is the single file `file` (the
    rest from the diffusers `folder`); returns (spec, trained layers) as `trained_layers`."""
    from tests.cli import dpipe_train, train_args

    result = dpipe_train(*train_args(
        run_dir, f"model={model}", f"model.path={file}", "model.tiny=false",
        f"model.single_file_config={folder}", "dataset=synthetic", "pipeline.stages=2",
        "pipeline.micro_batches=2", "optim.lr=1e-3", "train.checkpoint_every_steps=0",
        "train.max_steps=2"))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    spec, layers = trained_layers(run_dir)
    assert spec.single_file == file and spec.path == folder
    return spec, layers


def exported_lora_and_trained(run_dir: Path, spec, layers):
    """On a micro-batch of step 1: (its inputs, the exported LoRA loaded the way users load it
    (on the single file's transformer where the run had one), the trained layers' output)."""
    from dpipe.data.batches import step_micro_batches

    dataset, plan = cached_dataset(run_dir)
    inputs, _ = next(step_micro_batches(spec, dataset, plan, run_config(run_dir).train.timesteps,
                                        1, 0, 0))
    with torch.no_grad():
        got = spec.denoiser_forward(spec.load_denoiser_with_lora(run_dir / "lora"), inputs)
    return inputs, got, run_layers(layers, inputs)
