"""Values that make no sense fail before training, naming the key: every numeric key's range,
the paths and the pipeline's fit to the model (before any worker starts), a resume on another
dataset, a finished run, and the mistakes Hydra meets before the task (a YAML syntax error,
a run dir that cannot be made, an unknown key)."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dpipe.config.checks import validate
from dpipe.launch.prestart import check_before_workers
from dpipe.errors import ConfigError, DataError
from dpipe.models.registry import build_spec
from dpipe.train.checkpoint import check_resume, finished_run
from tests.cli import Result, dpipe_train
from tests.unit.test_config import _compose
from tests.unit.test_resume_config import fake_checkpoint, run_yaml

REPO = Path(__file__).resolve().parents[2]
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def base():
    """The default run config, composed once (a composition takes ~0.5 s)."""
    return _compose([])


def _with(base, key: str, value):
    cfg = copy.deepcopy(base)
    OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize("key,value,message", [
    ("model.max_text_tokens", 0, "model.max_text_tokens must be >= 1, got 0"),
    ("model.max_text_tokens", -1, "model.max_text_tokens must be >= 1, got -1"),
    ("optim.lr", NAN, "optim.lr must be a number > 0, got nan"),
    ("optim.lr", INF, "optim.lr must be a number > 0, got inf"),
    ("optim.lr", 0, "optim.lr must be a number > 0"),
    ("optim.eps", 0, "optim.eps must be a number > 0"),
    ("optim.weight_decay", -0.01, "optim.weight_decay must be a number >= 0"),
    ("optim.grad_clip", NAN, "optim.grad_clip must be a number >= 0"),
    ("optim.warmup_steps", -1, "optim.warmup_steps must be a number >= 0"),
    ("optim.betas", [0.9, 1.0], "optim.betas must be 2 numbers in [0, 1)"),
    ("optim.betas", [0.9, NAN], "optim.betas must be 2 numbers in [0, 1)"),
    ("train.timesteps.shift", 0, "train.timesteps.shift must be a number > 0, got 0.0"),
    ("train.timesteps.logit_std", 0, "train.timesteps.logit_std must be a number > 0"),
    ("train.timesteps.logit_mean", NAN, "train.timesteps.logit_mean"),
    ("model.lora.alpha", -4, "model.lora.alpha must be a number > 0, got -4.0"),
    ("model.lora.alpha", 0, "model.lora.alpha must be a number > 0"),
    ("model.lora.rank", 0, "model.lora.rank must be >= 1"),
    ("model.lora.dropout", 1.0, "model.lora.dropout must be in [0, 1)"),
    ("model.min_snr_gamma", -1, "model.min_snr_gamma must be a number >= 0"),
    ("train.keep_checkpoints", 0, "train.keep_checkpoints >= 1"),
    ("train.log_every", 0, "train.log_every must be >= 1"),
    ("train.audit_step", -1, "train.audit_step must be a number >= 0"),
    ("train.checkpoint_every_minutes", NAN, "train.checkpoint_every_minutes"),
    ("pipeline.memory_budget_gb", NAN, "pipeline.memory_budget_gb must be > 0"),
    ("dataset.num_images", 0, "dataset.num_images must be >= 1"),
    ("dataset.cache_workers", -1, "dataset.cache_workers must be >= 0"),
])
def test_a_value_out_of_its_range_names_the_key(base, key, value, message):
    with pytest.raises(ConfigError) as err:
        validate(_with(base, key, value))
    assert message in str(err.value)


@pytest.mark.parametrize("key,value", [
    ("model.lora.alpha", None), ("model.lora.alpha", 8), ("optim.weight_decay", 0),
    ("optim.grad_clip", 0), ("train.timesteps.shift", 3), ("model.max_text_tokens", 1),
    ("train.audit_step", 0),
    ("dataset.cache_workers", 0), ("optim.betas", [0, 0.5]),
])
def test_values_at_the_edges_of_their_ranges_are_fine(base, key, value):
    validate(_with(base, key, value))


def _flux_folder(tmp_path: Path, double: int, single: int) -> Path:
    """Only the transformer's config: the layer count is read from it, no weights."""
    folder = tmp_path / "flux"
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    (folder / "transformer" / "config.json").write_text(
        json.dumps({"num_layers": double, "num_single_layers": single}))
    return folder


def _run(tmp_path, *overrides):
    run = validate(_compose(["model=flux", f"model.path={_flux_folder(tmp_path, 2, 3)}",
                             f"dataset.cache_dir={tmp_path / 'cache'}",
                             "pipeline.micro_batches=16", *overrides]))
    return run, build_spec(run.model)


def test_a_valid_run_passes_the_checks_before_the_workers(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    run, spec = _run(tmp_path, "dataset=folder", f"dataset.path={photos}", "pipeline.stages=7")
    assert spec.pipeline_layer_count() == 7  # embedding + 2 double + 3 single blocks + head
    check_before_workers(run, tmp_path, spec)


def test_frame_modes_the_model_cannot_take_fail_before_the_workers(tmp_path):
    run, spec = _run(tmp_path, "dataset.conditioning.first=1")
    with pytest.raises(ConfigError, match=r"dataset.conditioning.first=1.0: model.family=flux at "
                                          r".* takes the frame mode\(s\) none only"):
        check_before_workers(run, tmp_path, spec)
    run, spec = _run(tmp_path, "dataset.conditioning.none=0.5")
    with pytest.raises(ConfigError, match=r"dataset.conditioning \(none=0.5\) sums to 0.5"):
        check_before_workers(run, tmp_path, spec)


def test_pipeline_longer_than_the_model_fails_before_the_workers(tmp_path):
    run, spec = _run(tmp_path, "pipeline.stages=8")
    with pytest.raises(ConfigError, match=r"pipeline.stages=8 but the model has only 7 pipeline "
                                          r"layers: use pipeline.stages <= 7"):
        check_before_workers(run, tmp_path, spec)
    run, spec = _run(tmp_path, "pipeline=four_stage", "pipeline.partition=explicit",
                     "pipeline.split=[1,2,7]")
    with pytest.raises(ConfigError, match=r"pipeline.split=\[1, 2, 7\]: layer indices must be < 7"):
        check_before_workers(run, tmp_path, spec)


TINY_MODELS = sorted(p.stem for p in (REPO / "conf" / "model").glob("tiny_*.yaml"))
# Options that pick another denoiser than the tiny config's own: Wan 2.2's high-noise expert
# (transformer/; the config trains transformer_2/).
OTHER_DENOISERS = [("tiny_wan22_a14b", ["model.min_t=0.875", "model.max_t=1"])]


@pytest.mark.parametrize("model, overrides", [(m, []) for m in TINY_MODELS] + OTHER_DENOISERS,
                         ids=[*TINY_MODELS, *(f"{m}-{o[0]}" for m, o in OTHER_DENOISERS)])
@pytest.mark.slow
def test_the_layer_count_from_the_config_is_the_built_pipelines(model, overrides):
    """Every family's count, read from its config file, equals the layers the workers build."""
    import torch

    spec = build_spec(validate(_compose([f"model={model}", *overrides])).model)
    spec.ensure_available()
    count = spec.pipeline_layer_count()
    built = spec.pipeline_layers(spec.load_denoiser(torch.float32))
    assert count == len(built) > 2


def test_an_sdxl_single_files_layer_count_comes_from_its_tensor_names():
    """Without a diffusers folder for its configs, the count is read from the file's header."""
    folder = build_spec(validate(_compose(["model=tiny_sdxl"])).model)
    folder.ensure_available()
    single = build_spec(validate(_compose(
        ["model=tiny_sdxl", f"model.path={folder.path / 'sd_xl_base_1.0.safetensors'}"])).model)
    assert single._config_dir is None
    assert single.pipeline_layer_count() == folder.pipeline_layer_count()


def test_a_cache_dir_that_is_a_file_fails_before_the_workers(tmp_path):
    a_file = tmp_path / "latents"
    a_file.write_text("not a folder")
    run, spec = _run(tmp_path, f"dataset.cache_dir={a_file}")
    with pytest.raises(ConfigError, match=f"dataset.cache_dir={a_file} is a file: give a folder"):
        check_before_workers(run, tmp_path, spec)
    run, spec = _run(tmp_path, f"dataset.cache_dir={a_file}/sub")
    with pytest.raises(ConfigError, match=f"is inside {a_file}, which is a file"):
        check_before_workers(run, tmp_path, spec)


def test_missing_dataset_folders_fail_before_the_workers(tmp_path):
    run, spec = _run(tmp_path, "dataset=folder", f"dataset.path={tmp_path / 'nowhere'}")
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=f"dataset.path folder {missing} does not exist"):
        check_before_workers(run, tmp_path, spec)
    photos = tmp_path / "photos"
    photos.mkdir()
    run, spec = _run(tmp_path, "dataset=folder", f"dataset.path={photos}",
                     f"dataset.directories=[{{path: {tmp_path / 'gone'}}}]")
    with pytest.raises(DataError, match=f"dataset.directories folder {tmp_path / 'gone'} does not"):
        check_before_workers(run, tmp_path, spec)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_an_unwritable_run_dir_fails_before_the_workers(tmp_path):
    run, spec = _run(tmp_path)
    locked = tmp_path / "run"
    locked.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match=f"the run dir {locked} is not writable"):
        check_before_workers(run, locked, spec)


def test_a_resume_on_another_dataset_is_refused_naming_both(tmp_path):
    old, new = tmp_path / "photos", tmp_path / "paintings"
    old.mkdir(), new.mkdir()
    fake_checkpoint(tmp_path, 10, run_yaml(f"dataset.path={old}"))
    with pytest.raises(ConfigError) as err:
        check_resume(tmp_path, run_yaml(f"dataset.path={new}"))
    message = str(err.value)
    assert f"in the checkpoint: {old}" in message and f"now: {new}" in message
    assert "name=tiny_flux-synthetic-paintings" in message and "train.resume=false" in message
    with pytest.raises(ConfigError, match="another dataset"):  # a folder added to the list
        check_resume(tmp_path, run_yaml(f"dataset.path={old}",
                                        f"dataset.directories=[{{path: {new}}}]"))


def test_the_same_folders_resume_whatever_they_hold_or_however_spelt(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    (tmp_path / "link").symlink_to(photos)
    fake_checkpoint(tmp_path, 10, run_yaml(f"dataset.path={photos}", "dataset.num_repeats=1"))
    (photos / "new.png").write_bytes(b"")  # files added to the same folder: the same dataset
    for spelling in (f"{photos}/", f"{tmp_path}/link", f"{tmp_path}/./photos"):
        step, _ = check_resume(tmp_path, run_yaml(f"dataset.path={spelling}",
                                                  "dataset.num_repeats=3"))
        assert step == 10


def test_a_run_is_finished_once_its_final_export_follows_its_last_checkpoint(tmp_path):
    export = tmp_path / "lora"
    fake_checkpoint(tmp_path, 20, None)
    assert finished_run(tmp_path, 20, export) is None  # no export yet (killed before it)
    (export / "step_10").mkdir(parents=True)
    assert finished_run(tmp_path, 20, export) is None  # step exports only
    (export / "pytorch_lora_weights.safetensors").write_bytes(b"")
    assert finished_run(tmp_path, 20, export) == 20
    assert finished_run(tmp_path, 21, export) is None  # more steps to train
    marker = tmp_path / "checkpoints" / "step_00000020" / "COMPLETE"
    later = time.time() + 60
    os.utime(marker, (later, later))  # an export from before the last checkpoint: stale
    assert finished_run(tmp_path, 20, export) is None


def _cli(*args: str) -> Result:
    return dpipe_train(*args, timeout=120)


@pytest.mark.slow
def test_a_yaml_syntax_error_in_a_users_config_file_is_one_line(tmp_path):
    local = tmp_path / "conf" / "local"
    local.mkdir(parents=True)
    (local / "default.yaml").write_text("optim:\n  lr: [1e-4\n")  # the `optional local` file
    proc = _cli("--config-dir", str(tmp_path / "conf"), "--cfg", "job")
    assert proc.code == 2, proc.err
    assert "Traceback" not in proc.err
    assert f"error: {local / 'default.yaml'}, line 3, column 1: not valid YAML" in proc.err


@pytest.mark.slow
def test_a_run_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = _cli(f"hydra.run.dir={tmp_path / 'a_file' / 'run'}")
    assert proc.code == 2, proc.err
    assert "Traceback" not in proc.err
    assert f"error: cannot write the run dir: {tmp_path / 'a_file' / 'run'}" in proc.err


@pytest.mark.slow
def test_a_misspelt_key_is_not_told_to_use_plus():
    proc = _cli("model.lora_rnk=3", "--cfg", "job")
    assert proc.code == 2, proc.err
    assert "error: unknown config key(s): 'model.lora_rnk': did you mean 'model.lora'? valid keys " \
        "of 'model':" in proc.err
    assert "+model.lora_rnk" not in proc.err and "Traceback" not in proc.err


@pytest.mark.slow
def test_a_misspelt_option_is_one_line_with_the_options_close_to_it():
    proc = _cli("model=tiny_wann")
    assert proc.code == 2, proc.err
    assert proc.err.splitlines() == [
        "error: model=tiny_wann: no such option of the model group (conf/model/); did you mean "
        "tiny_wan? (close to it: tiny_wan, tiny_wan_i2v, tiny_anima, tiny_wan_flf2v)"]
