"""train.loss: each family's `loss` averages the chosen per-element error (MSE, Huber, smooth
L1) with the dataset's mask weights, as torch's formulas give it; bad thresholds are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpipe.config.compose import compose_run
from dpipe.errors import ConfigError
from dpipe.models.registry import build_spec

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIGS = sorted(p.stem for p in (REPO / "conf" / "model").glob("tiny_*.yaml"))
LOSSES = [("mse", []), ("huber", ["train.huber_delta=0.3"]),
          ("smooth_l1", ["train.smooth_l1_beta=0.7"])]


def _formula(kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each loss by its definition, element by element."""
    d = (x - y).abs()
    if kind == "mse":
        return d * d
    if kind == "huber":  # delta 0.3
        return torch.where(d < 0.3, 0.5 * d * d, 0.3 * (d - 0.5 * 0.3))
    return torch.where(d < 0.7, 0.5 * d * d / 0.7, d - 0.5 * 0.7)  # smooth L1, beta 0.7


def _spec(config: str, kind: str, extra: list[str]):
    run = compose_run([f"model={config}", f"train.loss={kind}", *extra])
    spec = build_spec(run.model)
    spec.use_loss(run.train)
    return spec


@pytest.mark.parametrize("kind, extra", LOSSES)
@pytest.mark.parametrize("config", TINY_CONFIGS)
@pytest.mark.slow
def test_every_family_averages_the_chosen_error(config, kind, extra):
    """Errors on both sides of the thresholds; without mask weights the loss is the plain mean
    (SDXL's labels carry per-sample min-SNR weights, here 1)."""
    torch.manual_seed(0)
    outputs, target = torch.randn(2, 4, 3, 5) * 2, torch.randn(2, 4, 3, 5)
    spec = _spec(config, kind, extra)
    labels = (target, torch.ones(2)) if spec.family == "sdxl" else (target,)
    expected = _formula(kind, outputs, target).mean()
    torch.testing.assert_close(spec.loss(outputs, labels), expected)


@pytest.mark.parametrize("kind, extra", LOSSES)
def test_mask_weights_multiply_each_elements_error(kind, extra):
    """Flux's (B, N, C) tokens with per-token weights; Wan's latents with per-element ones."""
    torch.manual_seed(1)
    x, y = torch.randn(2, 6, 4) * 2, torch.randn(2, 6, 4)
    weight = torch.rand(2, 6, 1)
    spec = _spec("tiny_flux", kind, extra)
    torch.testing.assert_close(spec.loss(x, (y, weight)),
                               (weight * _formula(kind, x, y)).mean())

    x, y = torch.randn(1, 4, 2, 3, 3) * 2, torch.randn(1, 4, 2, 3, 3)
    weight = torch.rand(1, 1, 2, 3, 3)
    spec = _spec("tiny_wan", kind, extra)
    torch.testing.assert_close(spec.loss(x, (y, weight)),
                               (weight * _formula(kind, x, y)).mean())


def test_the_choice_changes_the_loss():
    """The same prediction: Huber with a small threshold is far below MSE for large errors."""
    x, y = torch.full((1, 4, 2), 3.0), torch.zeros(1, 4, 2)
    mse = _spec("tiny_flux", "mse", []).loss(x, (y,))
    huber = _spec("tiny_flux", "huber", ["train.huber_delta=0.1"]).loss(x, (y,))
    assert mse.item() == pytest.approx(9.0) and huber.item() == pytest.approx(0.1 * (3 - 0.05))


@pytest.mark.parametrize("override, message", [
    ("train.huber_delta=0", "train.huber_delta must be a number > 0"),
    ("train.smooth_l1_beta=-1", "train.smooth_l1_beta must be a number > 0"),
])
def test_bad_loss_settings_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        compose_run([override])


def test_an_unknown_loss_names_the_choices():
    with pytest.raises(Exception) as caught:
        compose_run(["train.loss=l1"])
    assert "expected one of [mse, huber, smooth_l1]" in str(caught.value.__cause__)
