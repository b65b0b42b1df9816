"""Checks shared by the families' unit tests (HunyuanVideo, LTX-Video, Qwen-Image, Chroma, ...): the
tiny model configs' specs, the pipeline layers against the diffusers forward on video-shaped
latents, activation checkpointing, the exactness of exported LoRA files, and which attention calls
get a mask."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import yaml
from torch.utils.checkpoint import checkpoint

from dpipe.config.schema import LoraConfig, TrainMode
from dpipe.models.spec import NoisedBatch
from dpipe.models.tiny_parts import seeded
from dpipe.train.lora import make_trainable

CAPTIONS = ["a red circle on a blue background", "two green stars"]


def tiny_spec(path, family: str, **values):
    """The spec of the tiny model at `path` as the families' unit tests configure it (16 text
    tokens, LoRA rank 4, alpha 8), `values` over that; its parts checked."""
    from omegaconf import OmegaConf

    from dpipe.config.schema import ModelConfig
    from dpipe.models.registry import build_spec

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": family, "path": str(path), "max_text_tokens": 16,
        "lora": {"rank": 4, "alpha": 8}, **values}))
    spec = build_spec(cfg)
    spec.ensure_available()
    return spec


# Every tiny model config (conf/model/tiny_*.yaml) by name: its family, the name its folder takes,
# and its values.
TINY_CONFIGS = {}
for _file in sorted((Path(__file__).resolve().parents[2] / "conf/model").glob("tiny_*.yaml")):
    _values = yaml.safe_load(_file.read_text())
    TINY_CONFIGS[_file.stem] = (_values.pop("family"), _values.pop("path").rsplit("/", 1)[1],
                                {k: v for k, v in _values.items() if k != "defaults"})


def tiny_config_spec(models: Path, config: str):
    """The spec of the tiny model config `config` (a TINY_CONFIGS key), its folder in `models`."""
    family, folder, values = TINY_CONFIGS[config]
    return tiny_spec(models / folder, family, **values)


def lora_denoiser(spec, rank: int = 4, alpha: float = 8.0, seed: int = 0):
    """The spec's denoiser with LoRA on its default targets and random (non-zero) B matrices,
    so that the adapters change the output."""
    denoiser = spec.load_denoiser(torch.float32)
    cfg = dataclasses.replace(spec.cfg, mode=TrainMode.lora, lora=LoraConfig(rank=rank, alpha=alpha))
    make_trainable(denoiser, cfg, spec.lora_targets())
    with seeded(seed):
        for name, param in denoiser.named_parameters():
            if "lora_B" in name:
                param.data = torch.randn_like(param) * 0.1
    return denoiser


def lora_state_dict(denoiser) -> dict[str, torch.Tensor]:
    """The adapters under peft's names, as pipeline stages hand them to `export_lora`."""
    return {n: p.detach().clone() for n, p in denoiser.named_parameters() if "lora_" in n}


def micro_batch(spec, encoders, pixels: torch.Tensor, t=(0.3, 0.8), seed: int = 0):
    """make_inputs' (inputs, labels) for encoded `pixels` and the test captions."""
    latents = spec.encode_images(encoders, pixels).float()
    text = {k: v.float() for k, v in spec.encode_prompts(encoders, CAPTIONS[:len(pixels)]).items()}
    with seeded(seed):
        noise = torch.randn_like(latents)
    t = torch.tensor(t[:len(pixels)])
    noisy, target = spec.noise(latents, noise, t)
    return spec.make_inputs(NoisedBatch(latents=latents, noise=noise, timesteps=t, noisy=noisy,
                                        target=target, text=text))


def noised_images(spec, encoders, captions: list[str], seed: int = 0) -> NoisedBatch:
    """A micro-batch of random 64x64 images with `captions`, noised at random t."""
    text = spec.encode_prompts(encoders, captions)
    g = torch.Generator().manual_seed(seed)
    x0 = spec.encode_images(encoders, torch.rand(len(captions), 3, 64, 64, generator=g) * 2 - 1)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.rand(len(captions), generator=g)
    noisy, target = spec.noise(x0, noise, t)
    return NoisedBatch(x0, noise, t, noisy, target, text)


def assert_same_tensors(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Every parameter and buffer of `got`, non-persistent buffers included, has the name, dtype
    and values of `want`'s."""
    got_tensors = {**dict(got.named_parameters()), **dict(got.named_buffers())}
    want_tensors = {**dict(want.named_parameters()), **dict(want.named_buffers())}
    assert set(got_tensors) == set(want_tensors)
    for name, value in want_tensors.items():
        assert got_tensors[name].dtype == value.dtype, (name, got_tensors[name].dtype, value.dtype)
        assert torch.equal(got_tensors[name], value), name


def latent_inputs(spec, encoders, latents: torch.Tensor, prompts: list[str], t) -> tuple:
    """make_inputs' input tuple with `latents` as the noisy latents (and noise and target, which
    the layers do not see) and `prompts` encoded: for checks of the layers alone."""
    text = spec.encode_prompts(encoders, prompts)
    batch = NoisedBatch(latents=latents, noise=latents, timesteps=torch.tensor(t),
                        noisy=latents, target=latents, text=text)
    return spec.make_inputs(batch)[0]


def attention_masks_of_layers_and_diffusers(monkeypatch, spec, layers, inputs, denoiser,
                                            diffusers_inputs):
    """The pipeline `layers` on `inputs`, then diffusers' forward of `denoiser` on
    `diffusers_inputs` (the text as cached, say), without gradients, with every
    `scaled_dot_product_attention` call's `attn_mask` recorded (None when unmasked, which leaves
    SDPA free to run flash; diffusers' dispatcher looks the function up at each call, so its
    calls count). Returns (layers' output, diffusers' output, layers' masks, diffusers' masks)."""
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        got = run(layers, inputs)
        ours = len(masks)
        expected = spec.denoiser_forward(denoiser, diffusers_inputs)
    return got, expected, masks[:ours], masks[ours:]


def run(layers, inputs, checkpointed: bool = False):
    x = inputs
    for layer in layers:
        # As dpipe's engine checkpoints a layer (pipeline.activation_checkpointing).
        x = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
    return x


def assert_layers_match(spec, denoiser, inputs, rtol=1e-5, atol=1e-5) -> torch.Tensor:
    with torch.no_grad():
        expected = spec.denoiser_forward(denoiser, inputs)
        got = run(spec.pipeline_layers(denoiser), inputs)
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    return got


def assert_layers_match_each_item_alone(spec, denoiser, inputs, target, alone_atol=2e-6) -> None:
    """The pipeline layers give the denoiser's forward on `inputs` (the shape of `target`), and
    each item's result is as the forward computes it alone: padding the text to the batch's or the
    run's length changes nothing."""
    with torch.no_grad():
        x = run(spec.pipeline_layers(denoiser), inputs)
        expected = spec.denoiser_forward(denoiser, inputs)
        alone = [spec.denoiser_forward(denoiser, tuple(v[i:i + 1] for v in inputs))
                 for i in range(len(target))]
    assert x.shape == target.shape
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, torch.cat(alone), rtol=1e-5, atol=alone_atol)


def assert_checkpointing_matches(spec, denoiser, inputs, labels) -> None:
    """Per-layer activation checkpointing gives the same loss and LoRA gradients."""
    layers = spec.pipeline_layers(denoiser)
    grads = []
    for checkpointed in (False, True):
        denoiser.zero_grad(set_to_none=True)
        loss = spec.loss(run(layers, inputs, checkpointed), labels)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in denoiser.named_parameters()
                      if p.requires_grad and p.grad is not None})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def deltas(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float = 1.0):
    """{module: scale * B @ A}: the weight change each LoRA makes."""
    return {name: scale * (b.float() @ a.float()) for name, (a, b) in pairs.items()}


def assert_block_costs_follow_flops(spec, layers, inputs, block_types, rel=0.1) -> None:
    """The spec's stage-balancing costs of its transformer blocks (double- and single-stream
    alike) are in proportion to their FLOPs, within `rel`; parameter counts are not."""
    from dpipe.models.spec import counted_layer_flops

    flops = counted_layer_flops(layers, inputs, fake=False)
    costs = spec.layer_costs(layers)
    blocks = [i for i, layer in enumerate(layers) if isinstance(layer, block_types)]
    from dpipe.bench.layers import layer_kind

    assert len({layer_kind(layers[i]) for i in blocks}) == 2, "expected two kinds of block"
    ratios = [costs[i] / flops[i] for i in blocks]
    assert max(ratios) / min(ratios) < 1 + rel, [f"{r:.3g}" for r in ratios]
