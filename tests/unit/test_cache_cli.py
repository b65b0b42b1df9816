"""`dpipe-cache build | show | prune` on the tiny FLUX.1 and a small folder."""

from __future__ import annotations

import re

import torch
from safetensors.torch import save_file

from dpipe.cli.cache import main
from dpipe.data.cache_store import TensorStore, cache_key
from tests.unit.test_data_support import write_image


def _overrides(tmp_path):
    return ["model=tiny_flux", "dataset=folder", f"dataset.path={tmp_path / 'data'}",
            f"dataset.cache_dir={tmp_path / 'cache'}", "dataset.resolutions=[32]"]


def test_build_show_prune(tmp_path, capsys):
    for i in range(3):
        write_image(tmp_path / "data" / f"{i}.png", (32, 32), seed=i, caption=f"shape {i}")
    args = _overrides(tmp_path)

    assert main(["show", *args]) == 0
    assert "use 6 entries: 0 cached, 6 missing" in capsys.readouterr().out

    assert main(["build", *args]) == 0
    # Each latent made decodes its image: the count says so (it once said "0 file(s) read").
    err = capsys.readouterr().err
    assert "6 made now (3 latents, 0 masks, 3 texts); 3 file(s) decoded to encode" in err, err
    store = TensorStore(tmp_path / "cache")
    assert len(store.keys()) == 6
    assert main(["build", *args]) == 0  # a rerun finds everything cached and decodes nothing
    assert "0 made now (0 latents, 0 masks, 0 texts); 0 file(s) decoded" in capsys.readouterr().err
    assert main(["show", *args]) == 0
    out = capsys.readouterr().out
    assert re.search(r"latents\s+3", out) and re.search(r"text\s+3", out)
    assert "6 cached, 0 missing" in out and "0 entries are not used" in out

    (tmp_path / "data" / "2.png").unlink()  # its latent and caption are now unused
    (tmp_path / "data" / "2.txt").unlink()
    assert main(["prune", *args]) == 0
    assert "2 unused entries" in capsys.readouterr().out and len(store.keys()) == 6  # dry run
    assert main(["prune", "--delete", *args]) == 0
    assert "removed 2 unused entries" in capsys.readouterr().out
    assert len(store.keys()) == 4


def test_errors_are_messages(tmp_path, capsys):
    assert main(["show", *_overrides(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_verify_names_damaged_entries_and_removes_them(tmp_path, capsys):
    for i in range(3):
        write_image(tmp_path / "data" / f"{i}.png", (32, 32), seed=i, caption=f"shape {i}")
    args = _overrides(tmp_path)
    assert main(["build", *args]) == 0
    store = TensorStore(tmp_path / "cache")
    kinds = {k: store.metadata(k)["kind"] for k in store.keys()}
    latent = next(k for k, kind in kinds.items() if kind == "latents")
    text = next(k for k, kind in kinds.items() if kind == "text")
    data = bytearray(store.path_for(latent).read_bytes())
    data[-5] ^= 0x08  # one bit of one latent
    store.path_for(latent).write_bytes(bytes(data))
    cut = store.path_for(text)
    cut.write_bytes(cut.read_bytes()[:-16])
    # An entry written before entries carried checksums: counted apart, never removed.
    old = cache_key(written="before checksums")
    store.path_for(old).parent.mkdir(parents=True, exist_ok=True)
    save_file({"latents": torch.zeros(4)}, store.path_for(old), metadata={"kind": "latents"})
    capsys.readouterr()

    # The cache alone: no dataset is needed to verify it.
    only_cache = [f"dataset.cache_dir={tmp_path / 'cache'}"]
    assert main(["verify", *only_cache]) == 1
    out = capsys.readouterr().out
    assert "7 entries read" in out and "4 match their checksum, 2 damaged, 1 have none" in out
    source = store.metadata(latent)["source"]
    assert f"{store.path_for(latent)} (latents of {source}): its tensors do not match" in out
    assert f"{cut}: unreadable" in out and "--remove" in out
    assert len(store.keys()) == 7  # listing only

    assert main(["verify", "--remove", *only_cache]) == 0
    assert "removed 2 damaged entries" in capsys.readouterr().out
    assert store.keys() == set(kinds) - {latent, text} | {old}
    assert main(["verify", *only_cache]) == 0
    assert "4 match their checksum, 0 damaged, 1 have none" in capsys.readouterr().out
    assert main(["build", *args]) == 0
    assert "2 made now (1 latents, 0 masks, 1 texts)" in capsys.readouterr().err
