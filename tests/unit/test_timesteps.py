"""Timestep sampling, the shift (`auto`: the family sampler's) and the per-sample loss weights,
checked against diffusers' own functions and schedulers."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_calculate_shift
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler)
from diffusers.training_utils import (
    compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3)

from dpipe.config.checks import validate
from dpipe.launch.prestart import check_before_workers
from dpipe.config.schema import TimestepConfig, TimestepSampling, TimestepWeighting
from dpipe.data.batches import noised_batch
from dpipe.data.evaluate import quantile_timestep
from dpipe.diffusion.noise import sample_generator
from dpipe.diffusion.timesteps import (
    calculate_shift, sample_timesteps, shift_of_mu, shift_timesteps)
from dpipe.diffusion.weighting import timestep_weights
from dpipe.errors import ConfigError
from dpipe.models.registry import build_spec
from dpipe.models.sampling import SampleRequest
from dpipe.models.sdxl import ddpm
from tests.unit.test_config import _compose
from tests.unit.test_data_support import tiny_flux_spec

REPO = Path(__file__).resolve().parents[2]
TINY_MODELS = sorted(p.stem for p in (REPO / "conf" / "model").glob("tiny_*.yaml"))


def _generators(n: int = 64):
    return [sample_generator(42, 3, slot, "t") for slot in range(n)]


# ---- sampling ---------------------------------------------------------------------------------
def test_the_default_draws_the_same_t_as_before():
    """The default config (logit-normal, mean 0, std 1, no shift) draws sigmoid(randn) from each
    sample's stream, bit for bit: runs made before the new choices resume on the same t."""
    cfg = TimestepConfig()
    for gen, again in zip(_generators(), _generators()):
        assert torch.equal(sample_timesteps(cfg, 1, gen),
                           torch.sigmoid(0.0 + 1.0 * torch.randn(1, generator=again)))


def test_logit_normal_and_mode_are_diffusers_densities():
    for cfg, scheme in [(TimestepConfig(logit_mean=0.3, logit_std=1.2), "logit_normal"),
                        (TimestepConfig(sampling=TimestepSampling.mode, mode_scale=1.29), "mode")]:
        for gen, again in zip(_generators(), _generators()):
            ours = sample_timesteps(cfg, 1, gen)
            theirs = compute_density_for_timestep_sampling(
                scheme, 1, logit_mean=cfg.logit_mean, logit_std=cfg.logit_std,
                mode_scale=cfg.mode_scale, generator=again)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


def test_cosmap_sampling_has_the_cosmap_density():
    """SD3's CosMap: the density of its t is diffusers' cosmap loss weighting,
    2 / (pi (1 - 2t + 2t^2)); checked through the CDF's slope at the quantiles."""
    cfg = TimestepConfig(sampling=TimestepSampling.cosmap)
    qs = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
    h = 1e-6
    for q in qs.tolist():
        t = quantile_timestep(cfg, q)
        slope = (quantile_timestep(cfg, q + h) - quantile_timestep(cfg, q - h)) / (2 * h)
        density = float(compute_loss_weighting_for_sd3("cosmap", torch.tensor([t])))
        assert slope * density == pytest.approx(1.0, rel=1e-4)  # dt/dq = 1 / p(t)
    drawn = sample_timesteps(cfg, 100_000, torch.Generator().manual_seed(0))
    assert drawn.min() >= 0 and drawn.max() <= 1
    assert drawn.median().item() == pytest.approx(0.5, abs=0.005)


@pytest.mark.parametrize("cfg", [TimestepConfig(sampling=TimestepSampling.mode, mode_scale=1.29),
                                 TimestepConfig(sampling=TimestepSampling.mode, mode_scale=-0.8),
                                 TimestepConfig(sampling=TimestepSampling.cosmap, shift=3.0),
                                 TimestepConfig(logit_mean=-0.5, shift=2.0),
                                 TimestepConfig(sampling=TimestepSampling.uniform)],
                         ids=["mode", "mode-negative", "cosmap-shifted", "logit-normal", "uniform"])
def test_eval_quantiles_are_the_sampled_distributions(cfg):
    """Evals run at quantiles of the training t: the drawn t's empirical quantiles match."""
    drawn = sample_timesteps(cfg, 100_000, torch.Generator().manual_seed(0))
    for q in (0.1, 0.5, 0.9):
        assert torch.quantile(drawn, q).item() == pytest.approx(quantile_timestep(cfg, q),
                                                                abs=0.005)


@pytest.mark.parametrize("name", ["sigmoid", "shifted_sigmoid"])
def test_sigmoid_is_logit_normals_other_name(name):
    run = validate(_compose([f"train.timesteps.sampling={name}"]))
    assert run.train.timesteps.sampling is TimestepSampling.logit_normal


# ---- the shift ----------------------------------------------------------------------------------
def test_the_shift_formulas_are_diffusers():
    for tokens in (16, 256, 1024, 4096, 8192):
        assert calculate_shift(tokens, 256, 4096, 0.5, 1.15) == pytest.approx(
            flux_calculate_shift(tokens, 256, 4096, 0.5, 1.15), abs=1e-12)
    t = torch.linspace(0.01, 1.0, 100, dtype=torch.float64)
    for kind in ("exponential", "linear"):
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type=kind)
        for mu in (0.3, 0.9, 1.4):
            torch.testing.assert_close(shift_timesteps(t, shift_of_mu(mu, kind)),
                                       scheduler.time_shift(mu, 1.0, t))


def test_auto_is_fluxs_shift_at_each_size():
    """FLUX.1: mu from the packed token count (2x2 patches of the latents) by the pipeline's
    calculate_shift with its scheduler's values, shift = exp(mu)."""
    spec = tiny_flux_spec()
    for h, w in [(128, 128), (64, 96), (16, 16)]:
        mu = flux_calculate_shift(h // 2 * w // 2, 256, 4096, 0.5, 1.15)
        assert spec.training_shift((4, h, w)) == pytest.approx(math.exp(mu))
    assert spec.training_shift((4, 128, 128)) == pytest.approx(math.exp(1.15))  # 4096 tokens


def _unshifted(scheduler):
    """A copy of a fresh scheduler with no shift of any kind (its spacing kept)."""
    plain = copy.deepcopy(scheduler)
    plain.register_to_config(use_dynamic_shifting=False, shift_terminal=None)
    if "flow_shift" in plain.config:
        plain.register_to_config(flow_shift=1.0)
    if hasattr(plain, "_shift"):
        plain._shift = 1.0
    return plain


@pytest.mark.parametrize("model", TINY_MODELS)
def test_auto_is_each_familys_sampling_schedule(model):
    """For every family, its sampler's sigmas (its own `set_timesteps`, its scheduler config)
    are the unshifted sigmas shifted by `training_shift`, at two sizes: so `shift=auto` trains
    at the noise levels the family samples at. (shift_terminal's stretch, which only moves the
    last steps, is taken out of both.) Ideogram 4's sigmas carry the size themselves (logit-
    normal about its mu): its unshifted ones are those about 0."""
    spec = build_spec(validate(_compose([f"model={model}"])).model)
    spec.ensure_available()
    sampling = spec.sampling()
    about_mu = hasattr(sampling, "resolution_mu")
    plain_sampling = copy.copy(sampling)
    if about_mu:
        plain_sampling.resolution_mu = lambda latents: 0.0
    m = spec.pixel_multiple
    shifts = []
    for width, height in [(4 * m, 2 * m), (8 * m, 8 * m)]:
        frames = sampling.frame_step + 1 if sampling.video else 1
        shape = sampling.latent_shape(SampleRequest(0, "x", "", 0, width, height, frames))
        latents = torch.zeros(1, *shape)
        shift = spec.training_shift(spec.cached_latent_shape(shape))  # as cached
        fresh = sampling.new_scheduler()
        if "shift" not in fresh.config and not fresh.config.get("use_flow_sigmas"):
            assert shift == 1.0  # a DDPM family's sampler shifts nothing
            return
        scheduler, plain = copy.deepcopy(fresh), _unshifted(fresh)
        scheduler.register_to_config(shift_terminal=None)
        # At the family's usual step count: FLUX.2's mu depends on it.
        sampling.set_timesteps(scheduler, sampling.default_steps, latents)
        plain_sampling.set_timesteps(plain, sampling.default_steps, latents)
        expected = shift_timesteps(plain.sigmas.double(), shift).float()
        # Ideogram 4's first sigma is clamped (to a log-SNR of -15) whatever mu is: compared
        # from the second.
        first = 1 if about_mu else 0
        torch.testing.assert_close(scheduler.sigmas.float()[first:], expected[first:], atol=1e-5,
                                   rtol=1e-5)
        shifts.append(shift)
    dynamic = sampling.new_scheduler().config.get("use_dynamic_shifting") or about_mu
    assert (shifts[0] != shifts[1]) == bool(dynamic and model not in (
        "tiny_lumina2", "tiny_hidream"))  # those pipelines' mu ignores the image size


def test_auto_follows_each_micro_batchs_bucket():
    """noised_batch draws from the same streams, shifted by the shift of its latents' size."""
    spec = tiny_flux_spec()
    cfg = TimestepConfig(shift="auto")
    text = {"t5": torch.zeros(2, 32, 32), "pooled": torch.zeros(2, 32)}
    drawn = {}
    for h, w in [(8, 8), (64, 64)]:
        batch = noised_batch(spec, torch.zeros(2, 4, h, w), text, cfg, 7, 3, range(2))
        base = torch.cat([sample_timesteps(TimestepConfig(), 1, sample_generator(7, 3, s, "t"))
                          for s in range(2)])
        torch.testing.assert_close(batch.timesteps,
                                   shift_timesteps(base, spec.training_shift((4, h, w))))
        drawn[h] = batch.timesteps
    assert (drawn[64] > drawn[8]).all()  # the larger image trains at more noise


def test_eval_at_auto_shift_uses_each_batchs_size():
    spec = tiny_flux_spec()
    cfg = TimestepConfig(shift="auto")
    assert quantile_timestep(cfg, 0.5, spec.training_shift((4, 64, 64))) == pytest.approx(
        float(shift_timesteps(torch.tensor(0.5, dtype=torch.float64),
                              spec.training_shift((4, 64, 64)))))
    with pytest.raises(ValueError, match="auto"):
        quantile_timestep(cfg, 0.5)


@pytest.mark.parametrize("value, ok", [("auto", True), (3, True), (2.5, True), ("3.0", True),
                                       ("fast", False), ("flux", False)])
def test_shift_takes_a_number_or_auto(value, ok):
    cfg = _compose([f"train.timesteps.shift={value}"])
    if ok:
        assert validate(cfg).train.timesteps.auto_shift == (value == "auto")
        return
    with pytest.raises(ConfigError, match=rf"train.timesteps.shift='{value}': give a number > 0 "
                                          r"\(1: no shift\) or auto"):
        validate(cfg)


def test_mode_scale_out_of_range_is_refused():
    with pytest.raises(ConfigError, match=r"train.timesteps.mode_scale must be in \[-1, 1.7519\]"):
        validate(_compose(["train.timesteps.mode_scale=2.0"]))


# ---- the weighting ------------------------------------------------------------------------------
def test_weights_are_diffusers_sd3_weightings():
    sigma = torch.linspace(1e-3, 1.0, 200)
    assert timestep_weights(TimestepWeighting.none, sigma) is None
    for scheme in ("sigma_sqrt", "cosmap"):
        torch.testing.assert_close(timestep_weights(TimestepWeighting(scheme), sigma),
                                   compute_loss_weighting_for_sd3(scheme, sigma))
    assert torch.isfinite(timestep_weights(TimestepWeighting.sigma_sqrt, torch.zeros(1))).all()


def test_weighting_weighs_each_samples_loss_in_a_familys_loss():
    """The weight reaches the family's loss through the mask path: FLUX's loss becomes the mean
    over samples of weight x that sample's mean squared error (diffusers' scripts' loss), and
    multiplies a dataset's masks."""
    spec = tiny_flux_spec()
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(3, 4, 8, 12, generator=gen)
    text = {"t5": torch.randn(3, 32, 32, generator=gen),
            "pooled": torch.randn(3, 32, generator=gen)}
    cfg = TimestepConfig(weighting=TimestepWeighting.cosmap, shift=3.0)
    batch = noised_batch(spec, latents, text, cfg, 0, 0, range(3))
    _, labels = spec.make_inputs(batch)
    outputs = torch.randn_like(labels[0])
    per_sample = (outputs - labels[0]).square().flatten(1).mean(1)
    weights = compute_loss_weighting_for_sd3("cosmap", batch.timesteps)
    torch.testing.assert_close(spec.loss(outputs, labels), (weights * per_sample).mean())
    mask = torch.rand(3, 1, 8, 12, generator=gen)
    masked = noised_batch(spec, latents, text, cfg, 0, 0, range(3), loss_weight=mask)
    torch.testing.assert_close(masked.loss_weight, mask * weights.view(3, 1, 1, 1))
    # Evals (fixed timesteps) are not weighed: their losses compare across weightings.
    fixed = noised_batch(spec, latents, text, cfg, 0, 0, range(3), timesteps=torch.full((3,), 0.5))
    assert fixed.loss_weight is None
    plain = noised_batch(spec, latents, text, TimestepConfig(shift=3.0), 0, 0, range(3))
    assert plain.loss_weight is None and torch.equal(plain.timesteps, batch.timesteps)


# ---- SDXL ---------------------------------------------------------------------------------------
def test_sdxl_debiased_estimation_weights():
    abar = ddpm.alphas_cumprod({"num_train_timesteps": 1000, "beta_start": 0.00085,
                                "beta_end": 0.012, "beta_schedule": "scaled_linear"})
    snr = abar / (1 - abar)
    eps = ddpm.loss_weights(abar, "epsilon", 0.0, debiased=True)
    torch.testing.assert_close(eps, 1 / snr.sqrt())
    # On the v loss, the same objective: ||v error||^2 = ||eps error||^2 (SNR + 1) / SNR.
    torch.testing.assert_close(ddpm.loss_weights(abar, "v_prediction", 0.0, debiased=True),
                               eps * snr / (snr + 1))
    both = ddpm.loss_weights(abar, "epsilon", 5.0, debiased=True)
    torch.testing.assert_close(both, ddpm.loss_weights(abar, "epsilon", 5.0) / snr.sqrt())
    assert torch.equal(ddpm.loss_weights(abar, "epsilon", 0.0), torch.ones_like(abar))


def test_sdxl_refuses_flow_matching_weights(tmp_path):
    run = validate(_compose(["model=tiny_sdxl", "train.timesteps.weighting=cosmap",
                             f"dataset.cache_dir={tmp_path / 'cache'}"]))
    with pytest.raises(ConfigError, match="model.debiased_estimation=true"):
        check_before_workers(run, tmp_path, build_spec(run.model))
