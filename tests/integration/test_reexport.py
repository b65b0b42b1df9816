"""`dpipe-export` writes a run's exports again from its checkpoints, in one process: the same
files training wrote (tensors and metadata), the EMA's too, for LoRAs and full fine-tunes; and a
HunyuanVideo LoRA that reaches the token refiner and the final layer exports every format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.cli import Result, dpipe_command, dpipe_train, train_args

pytestmark = pytest.mark.slow


def dpipe_export(*args: str) -> Result:
    return dpipe_command("dpipe-export", *args)


def contents(folder: Path) -> dict:
    """Every safetensors file under `folder`: its metadata and tensors; other files' text."""
    found = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = str(path.relative_to(folder))
        if path.suffix == ".safetensors":
            with safe_open(path, framework="pt") as f:
                found[name] = (f.metadata(), {k: f.get_tensor(k) for k in f.keys()})
        else:
            found[name] = path.read_text()
    return found


def assert_same(written: dict, again: dict) -> None:
    assert written.keys() == again.keys()
    for name, value in written.items():
        if isinstance(value, str):
            assert value == again[name], name
            continue
        metadata, tensors = value
        assert metadata == again[name][0], name
        assert tensors.keys() == again[name][1].keys(), name
        for key, tensor in tensors.items():
            other = again[name][1][key]
            assert tensor.dtype == other.dtype and tensor.equal(other), f"{name}: {key}"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, dict]:
    """A 2-stage LoRA with an EMA and a step export at step 2; its exports as written."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    result = dpipe_train(*train_args(
        run_dir, "model=tiny_flux", "dataset=synthetic", "pipeline.stages=2",
        "train.max_steps=4", "train.checkpoint_every_steps=2", "train.export_every_steps=2",
        "train.ema.decay=0.9"))
    assert result.code == 0, result.err[-3000:]
    return run_dir, contents(run_dir / "lora")


def test_a_lost_lora_export_is_written_again_from_the_checkpoints(lora_run):
    run_dir, written = lora_run
    assert "ema/pytorch_lora_weights.safetensors" in written
    assert "step_2/ema/flux_lora_comfyui.safetensors" in written
    shutil.rmtree(run_dir / "lora")
    final = dpipe_export(f"run={run_dir}")
    assert final.code == 0, final.err[-3000:]
    assert f"exported {run_dir / 'lora'}" in final.out
    step = dpipe_export(f"run={run_dir}", "checkpoint=step_2")
    assert step.code == 0, step.err[-3000:]
    assert_same(written, contents(run_dir / "lora"))


@pytest.mark.parametrize("args, message", [
    (["checkpoint=step_3"], "no such complete checkpoint; the checkpoints that verify: "
                            "step_00000002, step_00000004"),
    (["checkpoint=last"], "give a step, as step_<N> or <N>"),
    (["export=step_2"], "give run=<run dir> and optionally checkpoint=step_<N>"),
])
def test_a_wrong_export_request_is_named(lora_run, args, message):
    run_dir, _ = lora_run
    result = dpipe_export(f"run={run_dir}", *args)
    assert result.code == 2 and message in result.err, result.err[-2000:]
    assert "Traceback" not in result.err


def test_an_unverified_checkpoint_missing_a_layer_file_is_not_exported(lora_run, tmp_path):
    """Its COMPLETE without the list of files (as an older dpipe wrote it), a layer file gone:
    the export comes from the checkpoint before, saying so; asked for, it is refused, and only
    the checkpoints that verify are offered."""
    run_dir = tmp_path / "run"
    shutil.copytree(lora_run[0], run_dir)
    shutil.rmtree(run_dir / "lora")
    newest = run_dir / "checkpoints" / "step_00000004"
    complete = json.loads((newest / "COMPLETE").read_text())
    del complete["files"]
    (newest / "COMPLETE").write_text(json.dumps(complete))
    layer = next(p for p in sorted(newest.glob("layer_*.safetensors"))
                 if safe_open(p, framework="pt").keys())
    layer.unlink()

    result = dpipe_export(f"run={run_dir}")
    assert result.code == 0, result.err[-3000:]
    assert ("checkpoint step_00000004 is damaged: its COMPLETE lists no files to verify them by"
            in result.err and "; exporting from step_00000002 (step 2) instead" in
            result.err and "resuming" not in result.err), result.err[-3000:]
    assert f"exported {run_dir / 'lora' / 'step_2'}" in result.out
    assert not (run_dir / "lora" / "pytorch_lora_weights.safetensors").exists()

    result = dpipe_export(f"run={run_dir}", "checkpoint=step_4")
    assert result.code == 2, result.err[-3000:]
    assert "lists no files to verify them by" in result.err
    assert "(the checkpoints that verify: step_00000002)" in result.err, result.err[-3000:]
    assert not (run_dir / "lora" / "pytorch_lora_weights.safetensors").exists()


def test_a_folder_that_is_no_run_is_refused(tmp_path):
    result = dpipe_export(f"run={tmp_path}")
    assert result.code == 2 and "holds no run (no run.yaml)" in result.err


def test_a_full_fine_tune_is_exported_again(tmp_path):
    run_dir = tmp_path / "run"
    result = dpipe_train(*train_args(
        run_dir, "model=tiny_flux", "dataset=synthetic", "pipeline.stages=2",
        "model.mode=full", "train.max_steps=2", "train.checkpoint_every_steps=2"))
    assert result.code == 0, result.err[-3000:]
    written = contents(run_dir / "model")
    shutil.rmtree(run_dir / "model")
    again = dpipe_export(f"run={run_dir}")
    assert again.code == 0, again.err[-3000:]
    # The diffusers folder holds the same tensors; the shards may be cut differently (one per
    # pipeline layer instead of one per stage).
    def tensors(found: dict) -> dict:
        return {k: t for name, value in found.items() if name.endswith(".safetensors")
                for k, t in value[1].items()}
    assert_same({"all": ({}, tensors(written))}, {"all": ({}, tensors(contents(run_dir / "model")))})


def test_a_hunyuan_video_lora_on_the_refiner_and_final_layer_exports_every_format(tmp_path):
    """The targets that once left no lora/ at all: every format now names every module."""
    run_dir = tmp_path / "run"
    result = dpipe_train(*train_args(
        run_dir, "model=tiny_hunyuan_video", "dataset=synthetic", "pipeline.stages=2",
        "train.max_steps=2", "train.checkpoint_every_steps=2",
        "model.lora.targets=[to_q,add_v_proj,proj_mlp,norm_out.linear]"))
    assert result.code == 0, result.err[-3000:]
    record = json.loads((run_dir / "lora" / "exports.json").read_text())["formats"]
    assert len(record) >= 2 and all(r["written"] and not r["left_out"]
                                    for r in record.values()), record
    written = contents(run_dir / "lora")
    names = written["pytorch_lora_weights.safetensors"][1]
    assert any("token_refiner" in k for k in names) and any("norm_out" in k for k in names)
    shutil.rmtree(run_dir / "lora")
    again = dpipe_export(f"run={run_dir}")
    assert again.code == 0, again.err[-3000:]
    assert_same(written, contents(run_dir / "lora"))
