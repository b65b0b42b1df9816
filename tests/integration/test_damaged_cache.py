"""Damaged cache entries through real `dpipe-train` runs sharing one cache: a flipped bit in a
latent and a truncated caption embedding are re-made in the run that meets them (named in one
log line each), training on exactly what an undamaged cache gives; a damaged entry whose file
is gone stops the run naming the file. (A loader worker's path: tests/unit/test_data_loader.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from dpipe.data.cache_store import TensorStore
from tests.cli import dpipe_train, metrics, train_args
from tests.unit.test_data_support import write_image

pytestmark = pytest.mark.slow


def _entries(store: TensorStore, kind: str) -> dict[str, str]:
    """{file name: key} of the store's entries of `kind` ("latents" by source, "text" by
    caption)."""
    out = {}
    for key in store.keys():
        with safe_open(store.path_for(key), framework="pt") as file:
            meta = file.metadata()
        if meta["kind"] == kind:
            out[Path(meta["source"]).name if kind == "latents" else meta["caption"]] = key
    return out


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # an exponent bit of a value of the last tensor: times 4 or a quarter
    path.write_bytes(bytes(data))


def _train(run_dir: Path, data: Path, cache: Path, *extra: str, steps: int = 1):
    return dpipe_train(*train_args(run_dir, "model=tiny_flux", "dataset=folder",
                                   f"dataset.path={data}", f"dataset.cache_dir={cache}",
                                   "dataset.resolutions=[32]", f"train.max_steps={steps}", *extra))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    data, cache = root / "data", root / "cache"
    for i in range(12):  # an epoch longer than a step (4 samples): a resume can replay its rest
        write_image(data / f"{i}.png", (32, 32), seed=i, caption=f"a shape number {i}")
    clean = _train(root / "clean", data, cache, "dataset.log_batches=true")
    assert clean.code == 0, clean.out + clean.err
    return root, data, cache, [m["loss"] for m in metrics(root / "clean")]


def _trained(run_dir: Path) -> list[str]:
    """The names of the files the run trained on, in order (the data log of rank 0)."""
    records = [json.loads(line) for line in
               (run_dir / "data" / "batches-rank000.jsonl").read_text().splitlines()]
    return [Path(s.split("@")[0]).name for r in records for s in r["samples"]]


def test_damaged_entries_are_re_made_in_the_run_that_meets_them(runs):
    root, data, cache, losses = runs
    store = TensorStore(cache)
    first, second = _trained(root / "clean")[:2]  # both in the step that the runs train
    latent = _entries(store, "latents")[first]
    text = _entries(store, "text")[f"a shape number {second.split('.')[0]}"]
    _flip_a_bit(store.path_for(latent))
    cut = store.path_for(text)
    cut.write_bytes(cut.read_bytes()[:-40])

    result = _train(root / "damaged", data, cache)
    assert result.code == 0, result.out + result.err
    log = result.out + result.err
    assert "24 of 24 entries were present, 0 made now" in log  # found when read, not before
    for source, role, path in ((data / first, "latents", store.path_for(latent)),
                               (data / second, "caption embedding", cut)):
        said = [line for line in log.splitlines() if str(path) in line]
        assert said and all(f"the cache entry of {source} ({role}, {path}) was damaged" in line
                            and "re-made it" in line for line in said), log
    assert store.verify(latent) is True and store.verify(text) is True
    # The same entries, to float rounding: a re-made latent is encoded alone, not in a batch.
    assert [m["loss"] for m in metrics(root / "damaged")] == pytest.approx(losses, rel=1e-5)


def test_a_damaged_entry_whose_file_is_gone_stops_the_run_naming_it(runs):
    # A run resumed mid-epoch finishes the epoch with the entries it began with: here, one
    # whose file was deleted meanwhile, and damaged.
    root, data, cache, _ = runs
    run_dir = root / "clean"  # stopped after step 1 of its 3-step epoch (4 samples a step)
    name = sorted({f"{i}.png" for i in range(12)} - set(_trained(run_dir)))[0]
    store = TensorStore(cache)
    _flip_a_bit(store.path_for(_entries(store, "latents")[name]))
    gone = root / "elsewhere"
    gone.mkdir()
    (data / name).rename(gone / name)
    (data / name).with_suffix(".txt").rename((gone / name).with_suffix(".txt"))

    result = _train(run_dir, data, cache, "dataset.log_batches=true", steps=3)
    assert result.code != 0
    assert "Traceback" not in result.err, result.err
    assert f"its file {data / name} is gone" in result.err, result.err
    # As the message says: the same command again goes on without the file.
    again = _train(run_dir, data, cache, "dataset.log_batches=true", steps=3)
    assert again.code == 0, again.out + again.err
