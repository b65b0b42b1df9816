"""A damaged checkpoint never loads: the newest one with a changed file is named and the run
resumes from the one before, to the weights a straight run ends with; a file that verifies but
does not hold the layer's tensors is named; when every checkpoint is damaged the launcher says
so before any worker starts; a planted pickle never runs. One straight 2-stage run; each case
works on a copy of it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dpipe.train.checkpoint import MARKER, problem
from tests.cli import dpipe_train, train_args

pytestmark = pytest.mark.slow

RUN = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=2", "train.max_steps=4",
       "train.checkpoint_every_steps=2"]
EXPORT = Path("lora") / "pytorch_lora_weights.safetensors"
STARTED = "worker processes"  # the launcher's "starting N worker processes"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("integrity") / "straight"
    result = dpipe_train(*train_args(run_dir, *RUN))
    assert result.code == 0, f"{result.out}\n{result.err}"
    return run_dir


def _copy(straight: Path, tmp_path: Path) -> Path:
    """The run as a resume finds it: its checkpoints, without the final export (which would
    make it a finished run that starts nothing)."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    shutil.rmtree(run_dir / "lora")
    return run_dir


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _lora_layer(checkpoint: Path) -> Path:
    """A layer file that holds LoRA tensors (the first layers may train none)."""
    return next(p for p in sorted(checkpoint.glob("layer_*.safetensors")) if load_file(p))


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _resume(run_dir: Path):
    result = dpipe_train(*train_args(run_dir, *RUN))
    return result, result.out + result.err


def test_a_changed_file_is_named_and_the_run_resumes_from_the_previous_checkpoint(straight,
                                                                                 tmp_path):
    run_dir = _copy(straight, tmp_path)
    damaged = _lora_layer(_checkpoint(run_dir, 4))
    _flip_a_byte(damaged)
    result, said = _resume(run_dir)
    assert result.code == 0, said[-3000:]
    assert f"checkpoint step_00000004 is damaged: its file {damaged} changed" in said
    assert "resuming from step_00000002 (step 2) instead" in said
    # Verified once, by the launcher: the workers reuse its verdicts (and do not warn again).
    assert said.count("is damaged") == 1, said[-3000:]
    assert "Traceback" not in said
    # Steps 3 and 4 trained again from step 2's weights, optimizer state and data position.
    original, again = load_file(straight / EXPORT), load_file(run_dir / EXPORT)
    assert original.keys() == again.keys()
    for key in original:
        assert torch.equal(original[key], again[key]), key


def test_a_file_without_the_layers_tensors_is_named(straight, tmp_path):
    """A layer file replaced by one without tensors, and COMPLETE rewritten to match (as a
    copy from another run would be): the files verify, the strict key check names the file."""
    run_dir = _copy(straight, tmp_path)
    checkpoint = _checkpoint(run_dir, 4)
    emptied = _lora_layer(checkpoint)
    save_file({}, emptied)
    manifest = json.loads((checkpoint / MARKER).read_text())
    manifest["files"][emptied.name] = {"size": emptied.stat().st_size,
                                       "sha256": hashlib.sha256(emptied.read_bytes()).hexdigest()}
    (checkpoint / MARKER).write_text(json.dumps(manifest))
    assert problem(checkpoint) is None
    result, said = _resume(run_dir)
    assert result.code != 0
    assert f"cannot load the checkpoint file {emptied}" in said and "tensors missing" in said
    assert "train.resume=false" in said and "Traceback" not in said, said[-3000:]


def test_when_every_checkpoint_is_damaged_the_launcher_says_so_before_any_worker(straight,
                                                                                tmp_path):
    run_dir = _copy(straight, tmp_path)
    for step in (2, 4):
        _flip_a_byte(_lora_layer(_checkpoint(run_dir, step)))
    result, said = _resume(run_dir)
    assert result.code != 0
    assert f"no checkpoint in {run_dir / 'checkpoints'} can be loaded" in said
    assert "step_00000002: its file" in said and "step_00000004: its file" in said
    assert "train.resume=false" in said
    assert STARTED not in said and "Traceback" not in said, said[-3000:]


def test_each_kind_of_damage_is_found(straight, tmp_path):
    """In-process: what `problem` says of a truncated optimizer pickle, a missing file and an
    unreadable COMPLETE, on copies of one checkpoint."""
    source = _checkpoint(straight, 2)
    assert problem(source) is None

    def damaged_copy(name: str) -> Path:
        copy = tmp_path / name
        shutil.copytree(source, copy)
        return copy

    truncated = damaged_copy("truncated")
    pickle = truncated / "mp_rank_01_model_states.pt"
    size = pickle.stat().st_size
    pickle.write_bytes(pickle.read_bytes()[: size // 2])
    assert problem(truncated) == f"its file {pickle} has {size // 2} bytes, {size} were written"

    missing = damaged_copy("missing")
    layer = _lora_layer(missing)
    layer.unlink()
    assert problem(missing) == f"its file {layer} is missing"

    unreadable = damaged_copy("unreadable")
    (unreadable / MARKER).write_text('{"step": 2, "files": {')
    assert problem(unreadable).startswith(f"its {MARKER} cannot be read")


class _Plant:
    """Unpickled by a plain torch.load, it runs code: here, writing `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_a_planted_pickle_never_runs(straight, tmp_path):
    """A COMPLETE without its list of files (what an older dpipe wrote) leaves the planted
    pickle unverified: the resume is refused, naming the risk; allowed, the pickle is refused."""
    run_dir = _copy(straight, tmp_path)
    marker = tmp_path / "the planted code ran"
    for step in (2, 4):
        folder = _checkpoint(run_dir, step)
        planted = folder / "mp_rank_00_model_states.pt"
        torch.save({"module": _Plant(marker)}, planted)
        complete = json.loads((folder / MARKER).read_text())
        del complete["files"]
        (folder / MARKER).write_text(json.dumps(complete))

    result, said = _resume(run_dir)
    assert result.code == 2, said[-3000:]
    assert "lists no files to verify them by" in said and "train.resume_unverified=true" in said
    assert STARTED not in said and "Traceback" not in said, said[-3000:]
    assert not marker.exists()

    result = dpipe_train(*train_args(run_dir, *RUN, "train.resume_unverified=true"))
    said = result.out + result.err
    assert result.code == 2, said[-3000:]
    assert f"error: {planted} names objects that a checkpoint's state never holds" in said, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert not marker.exists()
