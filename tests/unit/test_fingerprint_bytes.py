"""Encoder fingerprints hash every byte of the weights, and a start re-reads only changed files."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from dpipe.models.fingerprint import DigestIndex, file_fingerprint, folder_fingerprint, index_dir

BIG = 96 << 20  # past the old sampled fingerprint's 64 MB whole-file limit: it read 32 of 96 MB


@pytest.fixture
def weights(tmp_path, monkeypatch) -> Path:
    """A VAE folder: a config and a 96 MB weights file (sparse: the test writes 1 MB of it)."""
    monkeypatch.setenv("DPIPE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_text('{"scaling_factor": 0.13}')
    with open(folder / "diffusion_pytorch_model.safetensors", "wb") as f:
        f.write(os.urandom(1 << 20))
        f.truncate(BIG)
    return folder


def _rewrite_keeping_size_and_mtime(path: Path, offset: int, data: bytes) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_byte_in_the_middle_of_a_large_file_changes_the_fingerprint(weights):
    before = folder_fingerprint(weights)
    big = weights / "diffusion_pytorch_model.safetensors"
    with open(big, "r+b") as f:  # 48 MB: between two of the old fingerprint's samples
        f.seek(BIG // 2)
        f.write(b"\x01")
    assert folder_fingerprint(weights) != before
    assert file_fingerprint(big) == hashlib.sha256(big.read_bytes()).hexdigest()


def test_a_second_call_reads_no_unchanged_file(weights):
    first = folder_fingerprint(weights)
    index = json.loads(next(index_dir().glob("*.json")).read_text())
    assert index["folder"] == os.path.realpath(weights)
    big = weights / "diffusion_pytorch_model.safetensors"
    st = big.stat()
    assert index["files"][big.name] == [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                                        hashlib.sha256(big.read_bytes()).hexdigest()]

    rels = sorted(index["files"])
    warm = DigestIndex(weights)
    warm.digests(rels, prune=True)
    assert warm.files_read == 0

    # The index's word is taken for an unchanged file: a digest planted in it is what the next
    # call uses (had the file been read, the fingerprint would equal the first).
    index_file = next(index_dir().glob("*.json"))
    index["files"][big.name][4] = "0" * 64
    index_file.write_text(json.dumps(index))
    assert folder_fingerprint(weights) != first
    # Touching the file alone (same size, same mtime, only its ctime moves) has it read again.
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert folder_fingerprint(weights) == first


def test_an_edit_that_restores_size_and_mtime_is_still_seen(weights):
    big = weights / "diffusion_pytorch_model.safetensors"
    first = folder_fingerprint(weights)
    # In place: the write moves the ctime, which os.utime cannot set back.
    _rewrite_keeping_size_and_mtime(big, BIG // 3, b"\xff" * 16)
    edited = folder_fingerprint(weights)
    assert edited != first
    # Replaced by another file (a copy renamed into place): another inode, and another ctime.
    other = weights.parent / "other.safetensors"
    with open(other, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.truncate(BIG)
    os.utime(other, ns=(big.stat().st_atime_ns, big.stat().st_mtime_ns))
    os.replace(other, big)
    assert folder_fingerprint(weights) not in (first, edited)


def test_a_removed_file_leaves_the_index_and_the_fingerprint(weights):
    first = folder_fingerprint(weights)
    (weights / "config.json").unlink()
    assert folder_fingerprint(weights) != first
    index = json.loads(next(index_dir().glob("*.json")).read_text())
    assert sorted(index["files"]) == ["diffusion_pytorch_model.safetensors"]


def test_an_unwritable_index_costs_time_not_correctness(weights, tmp_path, monkeypatch):
    expected = folder_fingerprint(weights)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DPIPE_CACHE", str(blocker))  # the index cannot be made under a file
    assert folder_fingerprint(weights) == expected
    assert folder_fingerprint(weights) == expected
