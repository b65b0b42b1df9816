"""A tiny model folder that another dpipe wrote is written again before a run reads it."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest

from dpipe.config.schema import ModelConfig
from dpipe.models import tiny_stamp
from dpipe.models.registry import build_spec
from dpipe.models.tiny_parts import write_once


def _writer(content: str):
    def write(tmp: Path) -> None:
        (tmp / "model_index.json").write_text("{}")
        (tmp / "weights.txt").write_text(content)
    return write


def test_a_current_folder_is_kept_and_a_stale_one_written_again(tmp_path):
    folder = tmp_path / "tiny"
    write_once(folder, "model_index.json", _writer("first"), "make_tiny_test")
    assert tiny_stamp.read_stamp(folder) == {"writer": "make_tiny_test",
                                              "code": tiny_stamp.code_digest()}
    write_once(folder, "model_index.json", _writer("second"), "make_tiny_test")
    assert (folder / "weights.txt").read_text() == "first"  # current: not written again

    stamp = json.loads((folder / tiny_stamp.STAMP).read_text())
    (folder / tiny_stamp.STAMP).write_text(json.dumps({**stamp, "code": "another dpipe"}))
    (folder / "left-over.bin").write_text("from the older writer")
    write_once(folder, "model_index.json", _writer("second"), "make_tiny_test")
    assert (folder / "weights.txt").read_text() == "second"
    assert not (folder / "left-over.bin").exists()
    assert not tiny_stamp.needs_writing(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # nothing set aside is left


def test_an_unstamped_folder_is_written_again_only_in_dpipes_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPIPE_CACHE", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / "models" / "tiny"
    elsewhere = tmp_path / "mine" / "tiny"
    for folder in (cached, elsewhere):
        folder.mkdir(parents=True)
        (folder / "model_index.json").write_text("{}")
        (folder / "weights.txt").write_text("written before the stamp")
        write_once(folder, "model_index.json", _writer("now"), "make_tiny_test")
    assert (cached / "weights.txt").read_text() == "now"
    assert (elsewhere / "weights.txt").read_text() == "written before the stamp"
    assert not (elsewhere / tiny_stamp.STAMP).exists()


@pytest.mark.parametrize("family,name", [("flux", "tiny-flux"), ("wan", "tiny-wan21_t2v"),
                                         ("sdxl", "tiny-sdxl")])
def test_a_model_config_s_tiny_folder_from_an_older_dpipe_is_replaced(tmp_path, monkeypatch,
                                                                      family, name):
    """The quick start's case: `model=tiny_flux` (`model.tiny=true`) finds a folder in
    `$DPIPE_CACHE/models/` that a dpipe from before the stamp wrote, with other weights (a tiny
    FLUX.1 from before cc18215 had a VAE that encodes no colours): the run gets today's model."""
    monkeypatch.setenv("DPIPE_CACHE", str(tmp_path))
    folder = tmp_path / "models" / name
    spec = build_spec(ModelConfig(family=family, path=str(folder), tiny=True))
    spec.ensure_available()
    fresh = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    (folder / tiny_stamp.STAMP).unlink()  # as an older dpipe left it
    vae = next(folder.glob("vae/*.safetensors"))
    vae.write_bytes(b"older weights")
    build_spec(ModelConfig(family=family, path=str(folder), tiny=True)).ensure_available()
    assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*")
            if p.is_file()} == fresh
