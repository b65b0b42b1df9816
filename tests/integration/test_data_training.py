"""Datasets through real `dpipe-train` runs: three aspect buckets with masks and an eval set.

- every micro-batch stays inside one bucket, and the pipeline stages and data-parallel ranks of
  a 2-stage x 2-DP run (4 processes) agree on every batch;
- a run stopped mid-epoch and resumed after files were added replays the rest of the epoch in
  the uninterrupted run's order (with the same losses), then trains on the new files;
- eval loss is identical across two runs and across stage counts.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
from PIL import Image

from tests.cli import dpipe_train, metrics, train_args
from tests.unit.test_data_support import write_image

pytestmark = pytest.mark.slow
SHAPES = {"sq": (64, 64), "wide": (128, 64), "tall": (64, 128)}


def _files(folder: Path, names: list[str]) -> None:
    for name in names:
        size = SHAPES[name.rstrip("0123456789")]
        write_image(folder / f"{name}.png", size, seed=hash(name) % 1000,
                    caption=f"a red {name} shape")
        mask = Image.new("L", size, 255)
        mask.paste(0, (0, 0, size[0] // 2, size[1]))  # the left half does not count
        (folder / "masks").mkdir(exist_ok=True)
        mask.save(folder / "masks" / f"{name}.png")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("buckets")
    _files(root / "train", [f"{k}{i}" for k in SHAPES for i in range(4)])
    for name, size in (("e0", (64, 64)), ("e1", (64, 64)), ("e2", (128, 64))):
        write_image(root / "eval" / f"{name}.png", size, seed=50 + len(name), caption="a shape")
    return root


def _args(data: Path, train_dir: Path | None = None, *extra: str) -> list[str]:
    train = train_dir or data / "train"
    return ["model=tiny_flux", "dataset=folder", "dataset.path=null",
            f"dataset.directories=[{{path:'{train}',mask_dir:masks}}]",  # eval: no masks
            "dataset.resolutions=[64]", "dataset.num_aspect_buckets=3",
            "dataset.log_batches=true", "dataset.eval.every_steps=4",
            f"dataset.eval.sets=[{{name:holdout,directories:[{{path:'{data / 'eval'}'}}]}}]",
            "optim.lr=1e-3", "pipeline.micro_batches=2", "train.checkpoint_every_steps=4",
            *extra]


def _train(run_dir: Path, *overrides: str, timeout: float = 300):
    result = dpipe_train(*train_args(run_dir, *overrides), timeout=timeout)
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    return result


def _batches(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted((run_dir / "data").glob("batches-rank*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _evals(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "eval.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _names(record: dict) -> list[str]:
    return [s.rsplit("/", 1)[-1] for s in record["samples"]]


def _by_step(records, rank=0):
    out = defaultdict(list)
    for r in records:
        if r["rank"] == rank:
            out[r["step"]].append(_names(r))
    return out


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    result = _train(run_dir, *_args(data), "pipeline.stages=2", "train.max_steps=8")
    return run_dir, result.out + result.err


def test_report_and_buckets(straight):
    run_dir, log = straight
    assert "dataset (train): 12 files" in log and "dataset (eval holdout): 3 files" in log
    for bucket in ("48x88", "64x64", "88x48"):
        assert bucket in log
    records = _batches(run_dir)
    assert {r["rank"] for r in records} == {0, 1}
    for r in records:  # latents (C, h, w): the bucket's pixels / 4 (the tiny VAE)
        w, h = map(int, r["bucket"].split("x"))
        assert r["shape"][2:] == [h // 4, w // 4] and len(r["samples"]) == 1
    # Both stages read the same samples for every micro-batch.
    key = lambda r: (r["step"], r["micro"], r["dp_rank"])  # noqa: E731
    first = {key(r): r["samples"] for r in records if r["rank"] == 0}
    last = {key(r): r["samples"] for r in records if r["rank"] == 1}
    assert first == last and len(first) == 16
    # Epoch 0 (steps 0-5) uses each of the 12 files once; with masks the loss is still finite.
    epoch0 = [n for step in range(6) for names in _by_step(records)[step] for n in names]
    assert sorted(epoch0) == sorted(f"{k}{i}.png@0" for k in SHAPES for i in range(4))
    assert all(m["loss"] == m["loss"] for m in metrics(run_dir))
    assert sorted(_evals(run_dir)) == [0, 4, 8]


def test_resume_after_adding_files_replays_the_epoch_then_uses_them(data, straight, tmp_path):
    straight_dir, _ = straight
    train_dir = tmp_path / "train"
    shutil.copytree(data / "train", train_dir)
    run_dir = tmp_path / "run"
    _train(run_dir, *_args(data, train_dir), "pipeline.stages=2", "train.max_steps=4")
    _files(train_dir, ["sq4", "wide4"])
    result = _train(run_dir, *_args(data, train_dir), "pipeline.stages=2", "train.max_steps=8")
    log = result.out + result.err
    assert "2 sample(s) added" in log and "continues in its saved order until step 6" in log

    mine, theirs = _by_step(_batches(run_dir)), _by_step(_batches(straight_dir))
    assert [mine[s] for s in range(6)] == [theirs[s] for s in range(6)]
    losses = {m["step"]: m["loss"] for m in metrics(run_dir)}
    for m in metrics(straight_dir)[:6]:  # steps 1-6: identical weights and samples
        assert losses[m["step"]] == m["loss"], m["step"]
    # Epoch 1 (from step 6) plans over the 14 files of the new dataset.
    history = json.loads((run_dir / "data" / "history.json").read_text())["segments"]
    assert [(s["start_step"], s["start_epoch"]) for s in history] == [(0, 0), (6, 1)]
    # The eval at step 4 ran on identical weights in both runs: identical numbers.
    assert _evals(run_dir)[4] == _evals(straight_dir)[4]
    assert _evals(run_dir)[0] == _evals(straight_dir)[0]


def test_eval_loss_does_not_depend_on_the_stage_count(data, straight, tmp_path):
    straight_dir, _ = straight
    run_dir = tmp_path / "one-stage"
    _train(run_dir, *_args(data), "pipeline.stages=1", "train.max_steps=4")
    one, two = _evals(run_dir), _evals(straight_dir)
    for step in (0, 4):
        assert one[step].keys() == two[step].keys()
        for key, value in one[step].items():
            assert value == pytest.approx(two[step][key], rel=1e-5, abs=1e-7), (step, key)
    for a, b in zip(metrics(run_dir), metrics(straight_dir)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)


def test_two_stages_by_two_data_parallel_ranks_agree_on_every_batch(data, tmp_path):
    run_dir = tmp_path / "pp2-dp2"
    _train(run_dir, *_args(data), "pipeline.stages=2", "pipeline.data_parallel=2",
           "train.max_steps=3", "dataset.eval.every_steps=0", "dataset.eval.before_training=false")
    records = _batches(run_dir)
    assert {r["rank"] for r in records} == {0, 1, 2, 3}
    # DeepSpeed's topology: rank = stage * 2 + data-parallel rank.
    by_rank = defaultdict(dict)
    for r in records:
        assert r["dp_rank"] == r["rank"] % 2
        by_rank[r["rank"]][(r["step"], r["micro"])] = (r["bucket"], r["samples"])
    assert by_rank[0] == by_rank[2] and by_rank[1] == by_rank[3]  # stage 0 == stage 1
    assert len(by_rank[0]) == 6  # 3 steps x 2 micro-batches
    for key in by_rank[0]:
        assert by_rank[0][key][0] == by_rank[1][key][0]  # both replicas in one bucket
        assert not set(by_rank[0][key][1]) & set(by_rank[1][key][1])
    # One epoch (3 steps of 2 x 2 samples) covers all 12 files once.
    seen = [s for rank in (0, 1) for _, samples in by_rank[rank].values() for s in samples]
    assert len(seen) == len(set(seen)) == 12
