"""The audio half of a micro-batch (audio-video families with model.audio=true): audio latents are
noised at the video's t from a noise stream of their own, the same for every stage and resume;
families without sound refuse model.audio=true before any worker starts."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from dpipe.config.schema import ModelConfig, TimestepConfig
from dpipe.data.batches import noised_batch
from dpipe.errors import ConfigError
from dpipe.models.registry import build_spec


def _spec(**values):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": "flux", "path": "/nowhere", **values}))
    return build_spec(cfg)


def test_audio_is_noised_at_the_videos_t_with_its_own_noise():
    spec = _spec()
    latents, audio = torch.randn(2, 4, 8, 8), torch.randn(2, 8, 5, 4)
    text = {"t5": torch.zeros(2, 3, 8)}
    batch = noised_batch(spec, latents, text, TimestepConfig(), 7, 3, range(4, 6), audio=audio)
    again = noised_batch(spec, latents, text, TimestepConfig(), 7, 3, range(4, 6), audio=audio)
    t = batch.timesteps.view(-1, 1, 1, 1)
    assert torch.equal(batch.audio, audio)
    assert torch.allclose(batch.audio_noisy, (1 - t) * audio + t * batch.audio_noise)
    assert torch.equal(batch.audio_target, batch.audio_noise - audio)
    assert torch.equal(batch.audio_noise, again.audio_noise)  # a pure function of (seed, step, slot)
    # Another stream than the video's noise (one stream would repeat the same first draws).
    assert not torch.equal(batch.audio_noise[0].flatten()[:16], batch.noise[0].flatten()[:16])
    without = noised_batch(spec, latents, text, TimestepConfig(), 7, 3, range(4, 6))
    assert without.audio is None and without.audio_noisy is None
    assert torch.equal(without.noise, batch.noise)  # the video's noise does not change with audio


def test_a_family_without_sound_refuses_model_audio():
    with pytest.raises(ConfigError, match=r"model.audio=true: model.family=flux has no audio"):
        _spec(audio=True)
    with pytest.raises(ConfigError, match=r"model.audio_loss_weight=-1.0"):
        _spec(audio_loss_weight=-1.0)
