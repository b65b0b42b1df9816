"""Cosmos-Predict2-specific checks on the tiny models, in this process: layers vs the diffusers
forward on images and 5-frame clips, Video2World's first-frame conditioning as the pipeline builds
it, the objective (the pipeline recovers x0 from the velocity target), the ComfyUI LoRA names,
activation checkpointing. The generic 2-process checks are in test_families.py."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch

from dpipe.config.schema import LoraConfig, ModelConfig, TrainMode
from dpipe.errors import ConfigError, DataError
from dpipe.models.comfyui import COMFY_PREFIX
from dpipe.models.cosmos_predict2.spec import COMFYUI_LORA, CosmosPredict2Spec
from dpipe.models.cosmos_predict2.tiny import make_tiny_cosmos_predict2
from dpipe.models.spec import NoisedBatch
from dpipe.train.lora import make_trainable
from tests.exports import export_lora

CAPTIONS = ["a red circle on a blue background", "a green square"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cosmos-models")


def _spec(models: Path, variant: str, **overrides) -> CosmosPredict2Spec:
    make_tiny_cosmos_predict2(models / variant, variant=variant)
    spec = CosmosPredict2Spec(ModelConfig(family="cosmos_predict2", path=str(models / variant),
                                          **overrides))
    spec.ensure_available()
    return spec


_ENCODERS: dict = {}


def _batch(spec, frames: int, seed: int = 0) -> NoisedBatch:
    if spec.path not in _ENCODERS:
        _ENCODERS[spec.path] = spec.load_encoders(torch.device("cpu"), torch.float32)
    encoders = _ENCODERS[spec.path]
    gen = torch.Generator().manual_seed(seed)
    latents = spec.encode_videos(encoders, torch.rand(2, 3, frames, 64, 64, generator=gen) * 2 - 1)
    noise = torch.randn(latents.shape, generator=gen)
    t = torch.rand(2, generator=gen)
    noisy, target = spec.noise(latents, noise, t)
    return NoisedBatch(latents=latents, noise=noise, timesteps=t, noisy=noisy, target=target,
                       text=spec.encode_prompts(encoders, CAPTIONS))


def _with_random_lora(spec, seed: int):
    torch.manual_seed(seed)
    denoiser = spec.load_denoiser(torch.float32)
    make_trainable(denoiser, spec.cfg, spec.lora_targets())
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return denoiser


def _run(layers, inputs):
    x = inputs
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("variant,frames", [("text2image", 1), ("video2world", 1),
                                            ("video2world", 5)])
def test_layers_reproduce_the_diffusers_forward(models, variant, frames):
    spec = _spec(models, variant, lora=LoraConfig(rank=4, alpha=4))
    denoiser = _with_random_lora(spec, seed=0)
    inputs, labels = spec.make_inputs(_batch(spec, frames))
    with torch.no_grad():
        out = _run(spec.pipeline_layers(denoiser), inputs)
        expected = spec.denoiser_forward(denoiser, inputs)
    assert out.shape == (2, 16, (frames - 1) // 4 + 1, 8, 8)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(spec.loss(out, labels))


def test_velocity_target_is_what_the_pipeline_turns_into_x0(models):
    """The pipelines feed x_sigma * c_in and take x0 = c_skip x_sigma + c_out F with t =
    sigma / (sigma + 1): our noisy input is x_sigma * c_in and our target F gives back x0."""
    spec = _spec(models, "text2image")
    batch = _batch(spec, 1)
    t = batch.timesteps.view(-1, 1, 1, 1, 1).double()
    sigma = t / (1 - t)
    x0, noise = batch.latents.double(), batch.noise.double()
    x_sigma = x0 + sigma * noise
    torch.testing.assert_close(x_sigma * (1 - t), batch.noisy.double())
    torch.testing.assert_close((1 - t) * x_sigma - t * batch.target.double(), x0)


def test_video2world_conditioning_matches_the_pipeline(models):
    spec = _spec(models, "video2world")
    batch = _batch(spec, 5)
    inputs, labels = spec.make_inputs(batch)
    hidden, t = inputs[0], inputs[1]
    torch.testing.assert_close(hidden[:, :16, 0], batch.latents[:, :, 0])
    torch.testing.assert_close(hidden[:, :16, 1], batch.noisy[:, :, 1])
    assert (hidden[:, 16, 0] == 1).all() and (hidden[:, 16, 1] == 0).all()
    sigma = torch.tensor(0.0001, dtype=torch.float32)  # the pipeline's sigma_conditioning
    assert (t[:, 0] == sigma / (sigma + 1)).all() and (t[:, 1] == batch.timesteps).all()
    out = torch.randn_like(batch.target)
    changed = out.clone()
    changed[:, :, 0] += 5
    assert float(spec.loss(out, labels)) == pytest.approx(float(spec.loss(changed, labels)))
    expected = (out[:, :, 1:] - batch.target[:, :, 1:]).square().mean()
    assert float(spec.loss(out, labels)) == pytest.approx(float(expected), rel=1e-6)


def test_tasks_and_frames_are_checked(models):
    t2i = _spec(models, "text2image")
    with pytest.raises(DataError, match="image model"):
        _batch(t2i, 5)
    with pytest.raises(ConfigError, match="Text2Image"):
        _spec(models, "text2image", i2v=True)
    with pytest.raises(ConfigError, match="Video2World"):
        _spec(models, "video2world", i2v=False)
    v2w = _spec(models, "video2world")
    with pytest.raises(DataError, match="4k\\+1"):
        v2w.encode_videos(_ENCODERS[v2w.path], torch.zeros(1, 3, 3, 64, 64))
    with pytest.raises(ConfigError, match="min_t"):
        _spec(models, "text2image", min_t=0.5)


def test_lora_files(models, tmp_path):
    """The diffusers file loads with transformer.load_lora_adapter and reproduces the model; the
    ComfyUI file holds the same weights (scale folded into B) under NVIDIA's names, which diffusers'
    single-file converter maps back to the trained modules."""
    from diffusers.loaders.single_file_utils import (
        convert_cosmos_transformer_checkpoint_to_diffusers)
    from safetensors.torch import load_file

    spec = _spec(models, "video2world", lora=LoraConfig(rank=4, alpha=8))
    denoiser = _with_random_lora(spec, seed=1)
    layers = spec.pipeline_layers(denoiser)
    state = {}
    for layer in layers:
        state.update(layer.denoiser_state_dict(trainable_only=True))
    files = export_lora(spec, state, tmp_path)
    assert [f.name for f in files] == ["pytorch_lora_weights.safetensors", COMFYUI_LORA]
    inputs, _ = spec.make_inputs(_batch(spec, 5))
    with torch.no_grad():
        loaded = spec.load_denoiser_with_lora(tmp_path)
        torch.testing.assert_close(spec.denoiser_forward(loaded, inputs), _run(layers, inputs),
                                   rtol=1e-4, atol=1e-5)
    comfy = load_file(tmp_path / COMFYUI_LORA)
    assert all(k.startswith(COMFY_PREFIX) for k in comfy)
    # original module (checkpoint key without ".weight") -> the diffusers module it converts to
    to_diffusers = {}
    for key in comfy:
        module = key[len(COMFY_PREFIX):].rsplit(".lora_", 1)[0]
        (converted,) = convert_cosmos_transformer_checkpoint_to_diffusers(
            {f"net.{module}.weight": None})
        to_diffusers[module] = converted.removesuffix(".weight")
    peft = {k.replace(".default.", "."): v for k, v in state.items()}
    assert set(to_diffusers.values()) == {k.rsplit(".lora_", 1)[0] for k in peft}
    for key, value in comfy.items():
        module, part = key[len(COMFY_PREFIX):].rsplit(".lora_", 1)
        scale = 2.0 if part.startswith("B") else 1.0  # alpha / rank, folded into B
        torch.testing.assert_close(value, peft[f"{to_diffusers[module]}.lora_{part}"] * scale)


def test_layers_train_the_same_under_activation_checkpointing(models):
    from torch.utils.checkpoint import checkpoint

    spec = _spec(models, "video2world", mode=TrainMode.full)
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    inputs, labels = spec.make_inputs(_batch(spec, 5))
    results = []
    for checkpointed in (False, True):
        denoiser.zero_grad()
        x = inputs
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        loss = spec.loss(x, labels)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in denoiser.parameters()]))
    (loss0, g0), (loss1, g1) = results
    torch.testing.assert_close(loss1, loss0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a)
