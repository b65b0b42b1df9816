"""A full disk while writing a checkpoint, an export or the latent cache: one message naming
what was being written, the bytes needed and free, and what is intact; no traceback; nothing
half-written left behind; and the same command, once there is space, goes on from what was
kept. The disk is a tmpfs of a chosen size (mounting needs root: elsewhere these tests skip,
saying so). A straight run on the ordinary disk gives the sizes and the reference weights.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import dpipe_train, train_args

pytestmark = pytest.mark.slow

RUN = ["model=tiny_flux", "dataset=synthetic", "pipeline.stages=2", "train.max_steps=4"]
EXPORT = Path("lora") / "pytorch_lora_weights.safetensors"
PAGE = 4096


def _on_disk(folder: Path) -> int:
    """The bytes a tmpfs holds for the files under `folder` (whole pages)."""
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in folder.rglob("*") if p.is_file())


class SmallDisk:
    def __init__(self, where: Path):
        self.where = where
        where.mkdir()
        self.mounted = False

    def mount(self, size: int) -> None:
        how = ["-o", f"remount,size={size}"] if self.mounted else ["-t", "tmpfs", "-o",
                                                                   f"size={size}", "tmpfs"]
        done = subprocess.run(["mount", *how, str(self.where)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        self.mounted = True

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.where)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = SmallDisk(tmp_path / "disk")
    yield disk
    disk.unmount()


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("disk_full") / "straight"
    # Its own cache dir: the size of this dataset's cache, whatever else the session cached.
    result = dpipe_train(*train_args(run_dir, *RUN, "train.checkpoint_every_steps=2",
                                     f"dataset.cache_dir={_own_cache(run_dir)}"))
    assert result.code == 0, f"{result.out}\n{result.err}"
    return run_dir


def _own_cache(straight: Path) -> Path:
    return straight.parent / "cache"


def _sizes(straight: Path) -> tuple[int, int, int]:
    """(one checkpoint, the export, everything else) in tmpfs pages."""
    checkpoint = _on_disk(straight / "checkpoints" / "step_00000004")
    export = _on_disk(straight / "lora")
    rest = _on_disk(straight) - _on_disk(straight / "checkpoints") - export
    return checkpoint, export, rest


def _train(run_dir: Path, *overrides: str):
    result = dpipe_train(*train_args(run_dir, *RUN, *overrides))
    return result, result.out + result.err


def _same_export(a: Path, b: Path, bitwise: bool = True) -> None:
    first, second = load_file(a / EXPORT), load_file(b / EXPORT)
    assert first.keys() == second.keys()
    if bitwise:
        assert all(torch.equal(first[k], second[k]) for k in first)
    else:
        # Each LoRA tensor within 0.1% of its size: an entry encoded from another file, or one
        # missing, moves the trained B matrices by their whole size.
        for k in first:
            scale = first[k].abs().max()
            assert (first[k] - second[k]).abs().max() <= 1e-3 * scale, k


def test_a_full_disk_at_a_checkpoint(straight, small_disk):
    checkpoint, _, rest = _sizes(straight)
    small_disk.mount(rest + checkpoint + checkpoint // 2)  # step 2's fits, step 4's does not
    run_dir = small_disk.where / "run"
    args = ("train.checkpoint_every_steps=2", "train.keep_checkpoints=2")
    result, said = _train(run_dir, *args)
    assert result.code != 0
    target = run_dir / "checkpoints" / "step_00000004"
    assert f"no space left to write the checkpoint {target}: it needs about" in said, said[-3000:]
    assert "are free there" in said
    assert ("The partial checkpoint step_00000004 was removed (rank" in said
            and f"the previous complete checkpoint {target.parent / 'step_00000002'} (step 2) "
                "is intact" in said)
    assert "Traceback" not in said
    assert not target.exists()

    small_disk.mount(64 << 20)
    result, said = _train(run_dir, *args)
    assert result.code == 0, said[-3000:]
    assert "resumed from" in said
    _same_export(straight, run_dir)


def test_a_full_disk_at_the_export(straight, small_disk):
    checkpoint, export, rest = _sizes(straight)
    small_disk.mount(rest + checkpoint + export // 2)
    run_dir = small_disk.where / "run"
    args = ("train.checkpoint_every_steps=0",)  # the one checkpoint: the last step's
    result, said = _train(run_dir, *args)
    assert result.code != 0
    assert f"no space left to write the export {run_dir / 'lora'}" in said, said[-3000:]
    assert (f"the newest complete checkpoint is {run_dir / 'checkpoints' / 'step_00000004'} "
            "(step 4): the same command resumes from it and writes the export" in said)
    assert "Traceback" not in said
    assert not list(run_dir.glob(".lora*")), "no partial export is left"

    small_disk.mount(64 << 20)
    result, said = _train(run_dir, *args)
    assert result.code == 0, said[-3000:]
    _same_export(straight, run_dir)


def test_a_full_disk_while_caching(straight, small_disk, tmp_path):
    """The latents of a new cache dir on the small disk: the entries written are kept, and the
    next run makes only the rest."""
    small_disk.mount(max(8 * PAGE, _on_disk(_own_cache(straight)) // 2))  # half the entries
    cache_dir = small_disk.where / "cache"
    args = (f"dataset.cache_dir={cache_dir}", "train.checkpoint_every_steps=0")
    run_dir = tmp_path / "run"
    result, said = _train(run_dir, *args)
    assert result.code != 0
    assert f"no space left to write the cache entry {cache_dir}" in said, said[-3000:]
    assert "The entries written so far are kept" in said and "dataset.cache_dir=" in said
    assert "Traceback" not in said
    kept = len(list(cache_dir.rglob("*.safetensors")))
    assert kept > 0 and not list(cache_dir.rglob(".*.tmp")), "whole entries only"

    small_disk.mount(64 << 20)
    result, said = _train(run_dir, *args)
    assert result.code == 0, said[-3000:]
    assert f"{kept} of" in said  # "cache: <kept> of <all> entries were present"
    # The second run encodes the rest in other VAE batches than the straight run did, and a
    # conv over a batch of one differs from one over several in the last bits (6.6e-7 on the
    # tiny FLUX VAE, 2026-12-05): the same training, not the same bits.
    _same_export(straight, run_dir, bitwise=False)
