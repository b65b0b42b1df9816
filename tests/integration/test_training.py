"""End to end through `dpipe-train`: real Hydra, real DeepSpeed pipelines in real processes (gloo).

One LoRA run on 1, 2 and 4 stages (a sweep) is shared by several tests; each other run is one
`dpipe-train` call.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import Sweep, dpipe_train, metrics, train_args, train_killed_at
from tests.integration.trained import run_config

pytestmark = pytest.mark.slow

STEPS = 6
# A learning rate large enough that 6 steps move the adapters measurably.
BASE = ["model=tiny_flux", "dataset=synthetic", "optim.lr=1e-3", f"train.max_steps={STEPS}",
        "train.checkpoint_every_steps=2", "pipeline.micro_batches=4"]


def _train(run_dir: Path, *overrides: str, timeout: float = 240):
    result = dpipe_train(*train_args(run_dir, *BASE, *overrides), timeout=timeout)
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    return result


@pytest.fixture(scope="module")
def stage_sweep(tmp_path_factory) -> Sweep:
    """The same LoRA run on 1, 2 and 4 pipeline stages: one sweep."""
    return Sweep(tmp_path_factory.mktemp("stages"), *BASE, "train.progress_bar=false",
                 "pipeline.stages=1,2,4", timeout=900)


@pytest.fixture(scope="module")
def two_stage_lora(stage_sweep) -> Path:
    return stage_sweep.run_dir("pipeline.stages=2")


def test_run_leaves_real_outputs(two_stage_lora):
    run = two_stage_lora
    assert (run / "run.yaml").is_file() and (run / ".hydra" / "config.yaml").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    steps = metrics(run)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert all(m["grad_norm"] > 0 and m["samples_per_s"] > 0 for m in steps)
    checkpoints = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_00000004", "step_00000006"]  # keep_checkpoints=2
    assert (run / "checkpoints" / "step_00000006" / "COMPLETE").is_file()
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()
    # plan.json: each process's predicted host peak (its stage read alone, as the plan states
    # it) and what each used; the cache's bytes; no GPU figure on the CPU.
    plan = json.loads((run / "plan.json").read_text())
    predicted, used = plan["predicted"]["host_peak_per_process"], plan["measured"]
    assert len(predicted) == len(used["host_peak_per_process"]) == 2
    assert all(0 < u <= p for u, p in zip(used["host_peak_per_process"], predicted))
    assert used["cache_disk"] > 0 and used["gpu_peak_per_stage"] is None
    assert "plan vs run: host peak per process " in (run / "train.log").read_text()


@pytest.fixture(scope="module")
def one_stage_lora(stage_sweep) -> Path:
    return stage_sweep.run_dir("pipeline.stages=1")


def test_two_stages_match_one_stage(two_stage_lora, one_stage_lora):
    one = one_stage_lora
    loss_1 = torch.tensor([m["loss"] for m in metrics(one)])
    loss_2 = torch.tensor([m["loss"] for m in metrics(two_stage_lora)])
    torch.testing.assert_close(loss_2, loss_1, rtol=1e-5, atol=1e-6)
    a = load_file(one / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(two_stage_lora / "lora" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)


def test_tflops_per_gpu_are_the_step_s_executed_flops_on_every_stage_count(stage_sweep):
    """perf/tflops_per_gpu: the FLOPs each step executes (counted on the meta device over the
    step's own micro-batches, dpipe.train.flops), per GPU and second. Times the step time and the
    GPUs it gives back the same FLOPs per step on 1, 2 and 4 stages, and those of the run's data."""
    from dpipe.data.batches import step_micro_batches
    from dpipe.models.registry import build_spec
    from dpipe.train.flops import StepFlops, architecture, shapes_of
    from tests.integration.trained import cached_dataset

    per_step = {}
    for stages in (1, 2, 4):
        run_dir = stage_sweep.run_dir(f"pipeline.stages={stages}")
        per_step[stages] = [m["tflops_per_gpu"] * 1e12 * m["step_time_s"] * stages
                            for m in metrics(run_dir)]
    run = run_config(run_dir)
    spec = build_spec(run.model)
    dataset, plan = cached_dataset(run_dir)
    flops = StepFlops(spec, run, architecture(spec.load_denoiser(torch.float32)))
    expected = [flops.of(shapes_of(*micro) for micro in step_micro_batches(
        spec, dataset, plan, run.train.timesteps, run.train.seed, step, 0))
        for step in range(STEPS)]
    assert expected[0] > 0
    for stages, got in per_step.items():
        assert got == pytest.approx(expected, rel=1e-9), stages


def test_lora_covers_every_linear_of_the_blocks_and_nothing_else(two_stage_lora):
    keys = load_file(two_stage_lora / "lora" / "pytorch_lora_weights.safetensors").keys()
    assert all(k.startswith(("transformer.transformer_blocks.", "transformer.single_transformer"))
               for k in keys)
    for name in (".attn.to_q.", ".attn.add_k_proj.", ".ff.net.2.", ".ff_context.net.0.proj.",
                 ".norm1.linear.", ".proj_mlp.", ".norm.linear."):
        assert any(name in k for k in keys), name


def test_killed_run_resumes_to_identical_weights(two_stage_lora, tmp_path):
    run_dir = tmp_path / "killed"
    train_killed_at(run_dir, "checkpoints/step_00000002/COMPLETE", *BASE, "pipeline.stages=2",
                    timeout=180)
    assert not (run_dir / "lora").exists(), "the run finished before the kill; nothing resumed"
    # A newer checkpoint that was cut off mid-write must never be picked.
    broken = run_dir / "checkpoints" / "step_00000005"
    broken.mkdir(parents=True, exist_ok=True)
    (broken / "layer_00-model_states.pt").write_bytes(b"truncated")

    result = _train(run_dir, "pipeline.stages=2")
    assert "resumed from" in result.err + result.out
    straight = metrics(two_stage_lora)
    resumed = metrics(run_dir)
    assert resumed[-1]["step"] == STEPS
    by_step = {m["step"]: m["loss"] for m in resumed}
    for m in straight:
        if m["step"] > 2:
            assert by_step[m["step"]] == m["loss"], f"step {m['step']} differs after resume"
    a = load_file(two_stage_lora / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_block_swap_and_activation_offload_train_bit_identically(two_stage_lora, tmp_path):
    """Two layers of each stage swap their frozen weights (copied between host tensors on the
    CPU, through the same bookkeeping as on a GPU) and every layer recomputes from an
    offloaded input: the losses and the LoRA are those of the plain run, bit for bit; the
    checkpoints of a run with parked weights save and export as usual."""
    run_dir = tmp_path / "swap"
    _train(run_dir, "pipeline.stages=2", "pipeline.blocks_to_swap=2",
           "pipeline.activation_checkpointing=offload")
    assert [m["loss"] for m in metrics(run_dir)] == [m["loss"] for m in metrics(two_stage_lora)]
    a = load_file(two_stage_lora / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_four_stages_match_one_stage(one_stage_lora, stage_sweep):
    """Four stages in four processes: the same losses and weights as one stage (fp32)."""
    four = stage_sweep.run_dir("pipeline.stages=4")
    loss_1 = torch.tensor([m["loss"] for m in metrics(one_stage_lora)])
    loss_4 = torch.tensor([m["loss"] for m in metrics(four)])
    torch.testing.assert_close(loss_4, loss_1, rtol=1e-5, atol=1e-6)
    a = load_file(one_stage_lora / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(four / "lora" / "pytorch_lora_weights.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)


def test_four_bf16_stages_with_mixed_dtypes_do_not_deadlock(one_stage_lora, tmp_path):
    """bf16 activations, fp32 adapters and int64 position ids cross three stage boundaries
    (DeepSpeed's buffer reuse once deadlocked such pipelines); losses stay near fp32's."""
    four = tmp_path / "four-bf16"
    _train(four, "pipeline.stages=4", "train.precision=bf16", "train.max_steps=2", timeout=400)
    loss_1 = torch.tensor([m["loss"] for m in metrics(one_stage_lora)][:2])
    loss_4 = torch.tensor([m["loss"] for m in metrics(four)])
    torch.testing.assert_close(loss_4, loss_1, rtol=3e-2, atol=1e-2)


# A middle stage receiving integers between floats (HiDream on 3 stages, 2 steps): the full runs
# of test_families.py.


def test_bf16_full_fine_tune_with_master_weights_matches_on_two_stages(tmp_path):
    """DeepSpeed's bf16 mode (bf16 layers, fp32 master weights in its optimizer, no autocast):
    the data arrives in bf16, and 2 stages (each first stage's backward one pass) train as 1."""
    sweep = Sweep(tmp_path, *BASE, "train.progress_bar=false", "train.max_steps=3",
                  "train.checkpoint_every_steps=0", "model.mode=full", "train.precision=bf16",
                  "optim.master_weights=true", "pipeline.zero_stage=1", "pipeline.stages=1,2",
                  timeout=600)
    one = torch.tensor([m["loss"] for m in metrics(sweep.run_dir("pipeline.stages=1"))])
    two = torch.tensor([m["loss"] for m in metrics(sweep.run_dir("pipeline.stages=2"))])
    assert len(one) == 3 and bool((one[1:] < one[0]).all())  # it trains
    torch.testing.assert_close(two, one, rtol=1e-2, atol=1e-3)
