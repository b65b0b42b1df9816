"""`model.base_dtype=fp8` through `dpipe-train`: 2 pipeline stages (gloo processes), checkpoints
without the base weights, and an exported LoRA that diffusers loads as usual."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import dpipe_train, metrics, train_args
from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers

pytestmark = pytest.mark.slow


def train_fp8_storage_on_two_stages(run_dir):
    """`model.base_dtype=fp8`: trains, and exports a LoRA that diffusers loads as usual."""
    result = dpipe_train(*train_args(
        run_dir, "model=tiny_flux", "dataset=synthetic", "optim.lr=1e-3", "train.max_steps=3",
        "train.checkpoint_every_steps=2", "pipeline.micro_batches=2", "pipeline.stages=2",
        "model.base_dtype=fp8", "train.loader_workers=1"))
    assert result.code == 0, f"dpipe-train failed:\n{result.out}\n{result.err[-3000:]}"

    # Checkpoints hold the adapters only: the fp8 base weights are frozen parameters.
    shards = list((run_dir / "checkpoints" / "step_00000003").glob("layer_*-model_states.*"))
    assert shards
    for shard in shards:
        state = load_file(shard)
        assert all("lora_" in k for k in state), [k for k in state if "lora_" not in k][:3]

    exported = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    assert exported and all(".lora_A." in k or ".lora_B." in k for k in exported)
    assert all(v.dtype == torch.float32 for v in exported.values())  # adapters trained in fp32

    # The exported LoRA, loaded by diffusers over the base model, is the trained one.
    spec, layers = trained_layers(run_dir)
    dataset, plan = cached_dataset(run_dir)
    from dpipe.data.batches import step_micro_batches

    inputs, _ = next(step_micro_batches(spec, dataset, plan, run_config(run_dir).train.timesteps,
                                        1, 0, 0))
    trained = run_layers(layers, inputs)
    with torch.no_grad():
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
        with_lora = spec.denoiser_forward(spec.load_denoiser_with_lora(run_dir / "lora"), inputs)
    assert (with_lora - base).abs().max() > 1e-5, "training left the LoRA without effect"
    torch.testing.assert_close(with_lora, trained, rtol=1e-4, atol=1e-5)


def test_fp8_storage_exports_a_lora_and_8bit_compute_trains_on_two_stages_as_on_one(tmp_path):
    """One test for fp8 storage and fp8 and int8 compute, so the fp8-storage run serves as the
    reference of the compute runs.

    `model.base_compute=fp8` through the real engine: the CPU runs the same `_scaled_mm` path
    as a GPU with fp8 matmuls, so the pipelined run (recomputing, with block swap) must equal the
    one-stage run exactly, and
    stay near the fp8-storage run (bf16-free math on the same e4m3 weights, fp8 activations).
    `model.base_compute=int8` (`_int_mm`, the CPU's as a GPU's), pipelined the same way, stays
    within 1% of it (0.14% measured on 2026-12-07).
    """
    storage = tmp_path / "storage"
    train_fp8_storage_on_two_stages(storage)
    runs = {"storage": torch.tensor([m["loss"] for m in metrics(storage)])}
    # The two-stage runs also recompute every layer and swap each stage's first layer: the 8-bit
    # matmul's backward must give the same result when it runs after a recompute, on weights
    # copied back from the host.
    recompute_swap = ["pipeline.activation_checkpointing=all", "pipeline.blocks_to_swap=1"]
    for name, compute, extra in [("one", "fp8", ["pipeline.stages=1"]),
                                 ("two", "fp8", ["pipeline.stages=2", *recompute_swap]),
                                 ("int8", "int8", ["pipeline.stages=2", *recompute_swap])]:
        result = dpipe_train(*train_args(
            tmp_path / name, "model=tiny_flux", "dataset=synthetic", "optim.lr=1e-3",
            "train.max_steps=3", "train.checkpoint_every_steps=2", "pipeline.micro_batches=2",
            "train.loader_workers=1", f"model.base_compute={compute}", *extra))
        assert result.code == 0, f"dpipe-train failed:\n{result.out}\n{result.err[-3000:]}"
        runs[name] = torch.tensor([m["loss"] for m in metrics(tmp_path / name)])
        log = (tmp_path / name / "train.log").read_text()
        assert f"frozen Linears multiply in {compute}" in log, log[-2000:]
        assert (name != "one") == ("pipeline.blocks_to_swap=1 on the CPU" in log), log[-2000:]
    assert torch.equal(runs["two"], runs["one"]), (runs["two"], runs["one"])
    for name, rtol in [("one", 2e-2), ("int8", 1e-2)]:
        assert not torch.equal(runs[name], runs["storage"])  # the activations were rounded
        torch.testing.assert_close(runs[name], runs["storage"], rtol=rtol, atol=0)
