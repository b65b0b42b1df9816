"""Cache keys and the atomic tensor store."""

from __future__ import annotations

import threading

import pytest
import torch

from dpipe.data import cache_store
from dpipe.data.cache_store import CACHE_FORMAT_VERSION, TensorStore, cache_key

BASE = dict(
    source="0" * 64,
    encoder={"family": "flux", "dtype": "bf16", "scales": [0.5, 1.0]},
    resolution=512,
    flip=False,
    note=None,
)


def _key(n: int = 0) -> str:
    return cache_key(item=n)


# --- keys --------------------------------------------------------------------------------------


def test_key_is_sha256_hex_and_stable():
    key = cache_key(**BASE)
    assert len(key) == 64 and int(key, 16) >= 0
    assert key == cache_key(**BASE)


def test_key_ignores_dict_order():
    reordered = dict(reversed(list(BASE.items())))
    reordered["encoder"] = {"scales": [0.5, 1.0], "dtype": "bf16", "family": "flux"}
    assert cache_key(**reordered) == cache_key(**BASE)


@pytest.mark.parametrize(
    "change",
    [
        {"source": "1" * 64},
        {"encoder": {"family": "flux", "dtype": "fp32", "scales": [0.5, 1.0]}},
        {"encoder": {"family": "flux", "dtype": "bf16", "scales": [1.0, 0.5]}},  # list order counts
        {"resolution": 1024},
        {"resolution": 512.0},
        {"flip": True},
        {"note": ""},
        {"extra": 1},
    ],
)
def test_key_changes_when_any_part_changes(change):
    assert cache_key(**{**BASE, **change}) != cache_key(**BASE)


def test_key_includes_format_version(monkeypatch):
    before = cache_key(**BASE)
    monkeypatch.setattr(cache_store, "CACHE_FORMAT_VERSION", CACHE_FORMAT_VERSION + 1)
    assert cache_key(**BASE) != before


@pytest.mark.parametrize("bad", [{"p": object()}, {"p": {1: "a"}}, {"p": [b"bytes"]}])
def test_key_refuses_values_without_one_json_form(bad):
    with pytest.raises(TypeError):
        cache_key(**bad)


def test_key_refuses_nan():
    with pytest.raises(ValueError):
        cache_key(scale=float("nan"))


# --- store -------------------------------------------------------------------------------------


def test_path_layout(tmp_path):
    key = _key()
    assert TensorStore(tmp_path).path_for(key) == tmp_path / key[:2] / f"{key}.safetensors"
    with pytest.raises(ValueError):
        TensorStore(tmp_path).path_for("../../etc/passwd")


def test_roundtrip_is_exact(tmp_path):
    store = TensorStore(tmp_path / "cache")
    base = torch.randn(4, 6)
    tensors = {
        "latents": torch.randn(16, 8, 8),
        "text": torch.randn(7, 32).to(torch.bfloat16),
        "mask": torch.rand(5) > 0.5,
        "ids": torch.arange(9, dtype=torch.int64),
        "transposed": base.t(),  # not contiguous
        "view": base[1:3],  # shares storage with `transposed`
        "scalar": torch.tensor(3.5),
    }
    key = _key()
    assert not store.has(key) and store.get(key) is None
    store.put(key, tensors, metadata={"source": "a.png"})
    assert store.has(key)
    loaded = store.get(key)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert list(store.path_for(key).parent.iterdir()) == [store.path_for(key)]  # no temp files


def test_put_replaces_an_entry(tmp_path):
    store = TensorStore(tmp_path)
    store.put(_key(), {"x": torch.zeros(2)})
    store.put(_key(), {"x": torch.ones(2)})
    assert torch.equal(store.get(_key())["x"], torch.ones(2))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "flip", "flip header"])
def test_damaged_entry_is_named_never_read(tmp_path, damage):
    store = TensorStore(tmp_path)
    key = _key()
    store.put(key, {"x": torch.randn(64, 64), "y": torch.ones(3, dtype=torch.bfloat16)})
    path = store.path_for(key)
    data = bytearray(path.read_bytes())
    if damage.startswith("flip"):  # one bit: in a tensor's bytes, or in a shape in the header
        at = data.index(b"[64,64]") + 2 if damage == "flip header" else len(data) - 1000
        data[at] ^= 0x02 if damage == "flip header" else 0x10
    else:
        data = {"truncate": data[: len(data) // 2], "garbage": b"\x00" * 100, "empty": b""}[damage]
    path.write_bytes(bytes(data))
    with pytest.raises(cache_store.DamagedEntry, match=str(path)):
        store.get(key)
    with pytest.raises(cache_store.DamagedEntry):
        store.verify(key)
    assert path.exists()  # left for `put` to replace (or `dpipe-cache verify --remove`)
    store.put(key, {"x": torch.zeros(2)})
    assert torch.equal(store.get(key)["x"], torch.zeros(2)) and store.verify(key) is True


def test_entry_without_checksum_is_read_unverified(tmp_path):
    # Written by dpipe before entries carried checksums: read as it is, reported by `verify`.
    from safetensors.torch import save_file

    store = TensorStore(tmp_path)
    key = _key()
    store.path_for(key).parent.mkdir(parents=True)
    save_file({"x": torch.ones(4)}, store.path_for(key), metadata={"kind": "latents"})
    assert torch.equal(store.get(key)["x"], torch.ones(4))
    assert store.verify(key) is False and store.verify(_key(1)) is None


def test_crash_mid_write_leaves_no_entry(tmp_path, monkeypatch):
    store = TensorStore(tmp_path)
    key = _key()
    written = []

    def save_part_then_die(tensors, filename, metadata=None):
        with open(filename, "wb") as file:
            file.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"x\":")  # a partial header
        written.append(filename)
        raise KeyboardInterrupt  # e.g. Ctrl-C; not an Exception subclass

    monkeypatch.setattr(cache_store, "save_file", save_part_then_die)
    with pytest.raises(KeyboardInterrupt):
        store.put(key, {"x": torch.ones(3)})
    # The partial file went to a temp name in the entry's folder, never to the entry's name.
    assert written and written[0].parent == store.path_for(key).parent
    assert written[0] != store.path_for(key)
    assert not store.has(key) and store.get(key) is None
    assert list(store.path_for(key).parent.iterdir()) == []  # the temp file was cleaned up

    monkeypatch.undo()
    store.put(key, {"x": torch.ones(3)})
    assert torch.equal(store.get(key)["x"], torch.ones(3))


def test_killed_writer_temp_file_is_not_an_entry(tmp_path):
    # A SIGKILL skips all cleanup; its temp file is left behind but must not count as an entry.
    store = TensorStore(tmp_path)
    key = _key()
    shard = store.path_for(key).parent
    shard.mkdir(parents=True)
    (shard / f".{key}.safetensors.123-abc.tmp").write_bytes(b"partial")
    assert not store.has(key) and store.get(key) is None


def test_concurrent_writers_of_one_key(tmp_path):
    store = TensorStore(tmp_path)
    key = _key()
    tensors = {"x": torch.arange(10_000, dtype=torch.float32)}
    start = threading.Barrier(8)

    def write():
        start.wait()
        for _ in range(5):
            store.put(key, tensors)
            assert torch.equal(store.get(key)["x"], tensors["x"])

    threads = [threading.Thread(target=write) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert list(store.path_for(key).parent.iterdir()) == [store.path_for(key)]


def test_put_refuses_non_tensors(tmp_path):
    with pytest.raises(TypeError):
        TensorStore(tmp_path).put(_key(), {"x": [1, 2, 3]})
    with pytest.raises(TypeError):
        TensorStore(tmp_path).put(_key(), {"x": torch.ones(1)}, metadata={"n": 1})


def test_key_maker_fields_are_stable_and_distinct(monkeypatch):
    maker = cache_store.KeyMaker(kind="latents", encoder={"vae": "abc"})
    key = maker.fields("0" * 64, "image", None, 512, 512, 1, 0)
    assert key == cache_store.KeyMaker(kind="latents", encoder={"vae": "abc"}).fields(
        "0" * 64, "image", None, 512, 512, 1, 0)
    others = {maker.fields("0" * 64, "image", None, 512, 512, 1, 1),
              maker.fields("0" * 64, "video", None, 512, 512, 1, 0),
              maker.fields("0" * 64, "image", 16.0, 512, 512, 1, 0),
              cache_store.KeyMaker(kind="latents", encoder={"vae": "abd"}).fields(
                  "0" * 64, "image", None, 512, 512, 1, 0),
              maker(source="0" * 64)}
    assert key not in others and len(others) == 5
    monkeypatch.setattr(cache_store, "CACHE_FORMAT_VERSION", CACHE_FORMAT_VERSION + 1)
    assert cache_store.KeyMaker(kind="latents", encoder={"vae": "abc"}).fields(
        "0" * 64, "image", None, 512, 512, 1, 0) != key


def test_keys_lists_entries_only(tmp_path):
    store = TensorStore(tmp_path)
    keys = {_key(i) for i in range(5)}
    for k in keys:
        store.put(k, {"x": torch.zeros(1)})
    shard = store.path_for(_key(0)).parent
    (shard / f".{_key(0)}.safetensors.1-a.tmp").write_bytes(b"")  # a killed writer's temp file
    (shard / "notes.txt").write_text("x")
    assert store.keys() == keys
