"""A dataset directory's `loss_weight` and `prior_preservation`: carried by its samples in the
manifest, applied per row of a micro-batch, and checked before any worker starts."""

from __future__ import annotations

import pytest
import torch

from dpipe.config.schema import TimestepConfig
from dpipe.data.batches import prior_rows, step_micro_batches
from dpipe.data.prepare import Layout, prepare
from dpipe.errors import ConfigError
from tests.unit.test_data_support import FakeSpec, dataset_config, tiny_flux_spec, write_image


def _two_directories(tmp_path, spec, **second):
    """Two images in `a/` (default settings) and two in `b/` (`second`), one 32x32 bucket."""
    for folder in ("a", "b"):
        for i in range(2):
            write_image(tmp_path / folder / f"{i}.png", (32, 32), seed=(10 if folder == "b" else 0) + i)
    cfg = dataset_config(directories=[{"path": str(tmp_path / "a")},
                                      {"path": str(tmp_path / "b"), **second}],
                         cache_dir=str(tmp_path / "cache"), resolutions=[32],
                         aspect_ratios=[1.0])
    return prepare(spec, cfg, torch.device("cpu"), torch.float32, Layout(4, 1, 1, 0))


def _by_folder(dataset):
    (bucket,) = dataset.plan.manifest.buckets
    return {s.source.split("/")[-2] + "/" + s.source.split("/")[-1]: s for s in bucket.samples}


def test_directory_settings_reach_their_samples_only(tmp_path):
    dataset = _two_directories(tmp_path, FakeSpec(), loss_weight=0.5, prior_preservation=True)
    samples = _by_folder(dataset)
    assert {k: (s.loss_weight, s.prior) for k, s in samples.items()} == {
        "a/0.png": (None, None), "a/1.png": (None, None),
        "b/0.png": (0.5, True), "b/1.png": (0.5, True)}
    ordered = [samples[k] for k in ("a/0.png", "b/1.png", "a/1.png", "b/0.png")]
    assert prior_rows(ordered) == [1, 3]


def test_loss_weight_scales_each_rows_loss(tmp_path):
    """The same step with and without b/'s weight: the labels carry 0.5 on b/'s rows and 1 on
    a/'s, and the loss equals the mean with those row weights."""
    spec = tiny_flux_spec()
    weighted = _two_directories(tmp_path / "w", spec, loss_weight=0.5)
    plain = _two_directories(tmp_path / "p", spec)
    (w_inputs, w_labels), = list(step_micro_batches(spec, weighted, weighted.plan,
                                                    TimestepConfig(), 0, 0, 0))
    (p_inputs, p_labels), = list(step_micro_batches(spec, plain, plain.plan,
                                                    TimestepConfig(), 0, 0, 0))
    assert len(p_labels) == 1 and len(w_labels) == 2  # no weights at all where every one is 1
    rows = [s.loss_weight or 1.0 for s in weighted.plan.micro_batch(0, 0, 0).samples]
    assert sorted(rows) == [0.5, 0.5, 1.0, 1.0]
    expected_weight = torch.tensor(rows).view(-1, 1, 1).expand_as(w_labels[0])
    assert torch.equal(w_labels[1], expected_weight)
    # The same files and draws in both (the directory's weight changes no noise or timestep).
    assert all(torch.equal(a, b) for a, b in zip(w_inputs, p_inputs))
    outputs = torch.randn_like(w_labels[0])
    per_row = ((outputs - w_labels[0]) ** 2).mean(dim=(1, 2))
    torch.testing.assert_close(spec.loss(outputs, w_labels),
                               (per_row * torch.tensor(rows)).mean())


def test_a_prediction_is_its_own_target_at_zero_loss():
    """What prior preservation relies on: the base model's output, made the target, gives the
    loss 0 (FLUX.2 cuts its reference tokens off, as its loss does)."""
    spec = tiny_flux_spec()
    outputs, data = torch.randn(2, 18, 16), torch.zeros(2, 18, 16)
    assert spec.loss(outputs, spec.prior_labels(outputs, (data,), [0, 1])) == 0
    labels = spec.prior_labels(outputs, (data,), [1])  # row 0 keeps its data target
    torch.testing.assert_close(labels[0], torch.stack([data[0], outputs[1]]))
    with pytest.raises(ConfigError, match="does not support prior_preservation"):
        spec.prior_labels(torch.randn(2, 20, 16), (data,), [0])


@pytest.mark.parametrize("value", [0, -1, float("nan")])
def test_a_loss_weight_that_is_not_positive_is_refused(tmp_path, value):
    with pytest.raises(ConfigError, match="loss_weight"):
        dataset_config(path=str(tmp_path), loss_weight=value)


@pytest.mark.parametrize("where", ["dataset.prior_preservation=true",
                                   "dataset.directories=[{path: /data/reg, "
                                   "prior_preservation: true}]"])
def test_prior_preservation_of_a_full_fine_tune_is_refused_before_any_worker(where):
    from dpipe.config.compose import compose_run

    with pytest.raises(ConfigError, match="prior_preservation=true .* use model.mode=lora"):
        compose_run(["model=tiny_flux", "dataset=folder", "dataset.path=/data/photos",
                     "model.mode=full", where])
