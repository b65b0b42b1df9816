"""Every `model.adapter` besides LoRA trains a 2-stage tiny Flux through `dpipe-train`, resumes
exactly, and exports a file that, loaded as the README says, reproduces the trained model. One
sweep trains all of them and one sweep resumes them from their step-2 checkpoints (as in
test_optimizers.py).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import Sweep, dpipe_command, metrics
from tests.integration.sampled import saved_latents
from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers

pytestmark = pytest.mark.slow

ADAPTERS = ["dora", "lokr", "loha"]
STEPS = 4
ARGS = ["model=tiny_flux", "dataset=synthetic", f"train.max_steps={STEPS}",
        "train.checkpoint_every_steps=2", "pipeline.stages=2", "pipeline.micro_batches=2",
        "optim.lr=1e-2", "train.progress_bar=false", "sample.prompts=[a red circle]",
        "sample.steps=2", "sample.save_latents=true"]
LORA_DIR = Path("lora")
EXPORT = LORA_DIR / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Sweep:
    return Sweep(tmp_path_factory.mktemp("adapters"), *ARGS,
                 f"model.adapter={','.join(ADAPTERS)}", timeout=900)


@pytest.fixture(scope="module")
def resumed(straight, tmp_path_factory) -> Sweep:
    """The same sweep on copies of the straight runs cut back to their step-2 checkpoint."""
    sweep_dir = tmp_path_factory.mktemp("resumed")
    for point in straight.points:
        source = Path(point["run_dir"])
        copy = sweep_dir / source.relative_to(source.parent)
        shutil.copytree(source, copy)
        shutil.rmtree(copy / "checkpoints" / "step_00000004")
        shutil.rmtree(copy / "lora")
        shutil.rmtree(copy / "samples" / "step_4")
    sweep = Sweep(sweep_dir, *ARGS, f"model.adapter={','.join(ADAPTERS)}", timeout=900)
    assert sweep.result.err.count("resumed from") == len(ADAPTERS), sweep.result.err[-3000:]
    return sweep


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapter_trains_on_two_stages_and_resumes_exactly(adapter, straight, resumed):
    run_dir = straight.run_dir(f"model.adapter={adapter}")
    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    losses = [m["loss"] for m in steps]
    assert all(math.isfinite(x) for x in losses) and all(m["grad_norm"] > 0 for m in steps)
    assert len(set(losses)) == len(losses), losses  # the weights change from step to step
    export = load_file(run_dir / EXPORT)
    assert any(f".{adapter if adapter != 'loha' else 'hada'}_" in k or "magnitude" in k
               for k in export)

    again = resumed.run_dir(f"model.adapter={adapter}")
    by_step = {m["step"]: m["loss"] for m in metrics(again)}
    for m in steps[2:]:
        assert by_step[m["step"]] == m["loss"], f"{adapter}: step {m['step']} differs"
    for name in sorted(p.name for p in (run_dir / LORA_DIR).glob("*.safetensors")):
        first, second = load_file(run_dir / LORA_DIR / name), load_file(again / LORA_DIR / name)
        assert sorted(first) == sorted(second), name
        for key in first:
            assert torch.equal(first[key], second[key]), f"{adapter}: {name}: {key}"


def _load_exported(spec, lora_dir: Path, adapter: str):
    """The export loaded the way the README says: FluxPipeline.load_lora_weights for DoRA,
    the transformer's load_lora_adapter for LoKr, peft for LoHa."""
    from diffusers import FluxPipeline

    from dpipe.models.adapters import load_adapter_file

    pipe = FluxPipeline.from_pretrained(spec.path, text_encoder=None, text_encoder_2=None,
                                        vae=None, tokenizer=None, tokenizer_2=None,
                                        transformer=spec.load_denoiser(torch.float32))
    if adapter == "dora":
        pipe.load_lora_weights(str(lora_dir))
    elif adapter == "lokr":
        pipe.transformer.load_lora_adapter(str(lora_dir), weight_name=EXPORT.name,
                                           prefix="transformer")
    else:
        load_adapter_file(pipe.transformer, lora_dir / EXPORT.name)
    return pipe.transformer


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_the_exported_adapter_reproduces_the_trained_model(adapter, straight):
    from dpipe.data.batches import step_micro_batches

    run_dir = straight.run_dir(f"model.adapter={adapter}")
    spec, layers = trained_layers(run_dir)
    dataset, plan = cached_dataset(run_dir)
    inputs, _ = next(step_micro_batches(spec, dataset, plan, run_config(run_dir).train.timesteps,
                                        1, 0, 0))
    with torch.no_grad():
        got = spec.denoiser_forward(_load_exported(spec, run_dir / LORA_DIR, adapter), inputs)
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
    trained = run_layers(layers, inputs)
    assert (trained - base).abs().max() > 1e-5, "training left the adapter without effect"
    torch.testing.assert_close(got, trained, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("adapter", ["lokr", "loha"])
def test_dpipe_sample_samples_the_export_as_training_sampled_it(adapter, straight):
    """dpipe-sample puts a LoKr or LoHa export on the denoiser through peft (the families'
    pipelines load LoRA keys only): its sample equals the one training made at its last step."""
    run_dir = straight.run_dir(f"model.adapter={adapter}")
    done = dpipe_command("dpipe-sample", f"run={run_dir}")
    assert done.code == 0, done.out + done.err[-3000:]
    torch.testing.assert_close(saved_latents(run_dir / "samples" / "sampled-final", 0),
                               saved_latents(run_dir / "samples" / "step_4", 0),
                               rtol=1e-4, atol=1e-5)
