"""The tiny HiDream-I1: loads (with Llama from text_encoder_4/) and generates with diffusers;
pipeline layers reproduce the MoE transformer for square and padded non-square latents, in
training mode with gradients through the experts; the ComfyUI LoRA file loads like the diffusers
one; the target has HiDream's sign."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dpipe.config.schema import LoraConfig, ModelConfig
from dpipe.errors import ModelLoadError
from dpipe.models.hidream.spec import COMFYUI_FILE, LORA_TARGETS, HiDreamSpec
from dpipe.models.hidream.tiny import make_tiny_hidream
from dpipe.train.lora import make_trainable

PROMPTS = ["a red circle on a blue background", "a photo of two green stars"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_hidream(tmp_path_factory.mktemp("models") / "hidream")


def _spec(tiny, **kw) -> HiDreamSpec:
    return HiDreamSpec(ModelConfig(family="hidream", path=str(tiny), max_text_tokens=32,
                                   lora=LoraConfig(rank=4, alpha=2), **kw))


@pytest.fixture(scope="module")
def pipe(tiny):
    return _spec(tiny).load_encoders(torch.device("cpu"), torch.float32)


def test_generates_an_image(tiny, pipe):
    from diffusers import HiDreamImagePipeline

    full = HiDreamImagePipeline.from_pretrained(
        tiny, transformer=_spec(tiny).load_denoiser(torch.float32), text_encoder=pipe.text_encoder,
        text_encoder_2=pipe.text_encoder_2, text_encoder_3=pipe.text_encoder_3,
        text_encoder_4=pipe.text_encoder_4, tokenizer_4=pipe.tokenizer_4)
    full.default_sample_size = 16  # the pipeline renders a fixed area: 64x64 here
    out = full(PROMPTS[0], height=64, width=64, num_inference_steps=2, max_sequence_length=32,
               generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.images.shape == (1, 64, 64, 3) and np.isfinite(out.images).all()


def test_llama_must_be_linked_in(tiny, tmp_path):
    copy = tmp_path / "hidream"
    copy.mkdir()
    for child in tiny.iterdir():
        if child.name not in ("text_encoder_4", "tokenizer_4"):
            (copy / child.name).symlink_to(child)
    with pytest.raises(ModelLoadError, match="Llama-3.1-8B-Instruct"):
        _spec(copy).ensure_available()


def _inputs(spec, pipe, h, w, gen):
    text = spec.encode_prompts(pipe, PROMPTS)
    assert text["llama"].shape[:2] == (2, 4)  # batch first in the cache
    x0 = torch.randn(2, 16, h, w, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.tensor([0.25, 0.75])
    noisy, target = spec.noise(x0, noise, t)
    torch.testing.assert_close(target, x0 - noise)  # the pipeline negates the model's output
    from dpipe.models.spec import NoisedBatch

    return spec.make_inputs(NoisedBatch(x0, noise, t, noisy, target, text))


@pytest.mark.parametrize("h,w", [(16, 16), (16, 8)])  # (16, 8): diffusers pads to max_seq
def test_layers_reproduce_the_transformer(tiny, pipe, h, w):
    spec = _spec(tiny)
    inputs, labels = _inputs(spec, pipe, h, w, torch.Generator().manual_seed(0))
    transformer = spec.load_denoiser(torch.float32)
    make_trainable(transformer, spec.cfg, spec.lora_targets())
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    layers = spec.pipeline_layers(transformer)
    for train in (False, True):  # diffusers' inference and training MoE paths
        transformer.train(train)
        x = inputs
        for layer in layers:
            x = layer(x)
            assert all(t.is_contiguous() for t in (x if isinstance(x, tuple) else (x,)))
        with torch.no_grad():
            expected = spec.denoiser_forward(transformer, inputs)
        assert transformer.training == train
        torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)
    spec.loss(x, labels).backward()
    expert_grads = [p.grad for n, p in transformer.named_parameters()
                    if "lora_" in n and ".experts." in n]
    assert expert_grads and all(g is not None for g in expert_grads)


def test_comfyui_lora_loads_like_the_diffusers_file(tiny, pipe, tmp_path):
    spec = _spec(tiny)
    transformer = spec.load_denoiser(torch.float32)
    make_trainable(transformer, spec.cfg, spec.lora_targets())
    gen = torch.Generator().manual_seed(1)
    lora = {n: torch.randn(p.shape, generator=gen) * 0.05
            for n, p in transformer.named_parameters() if "lora_" in n}
    spec.export_lora(lora, tmp_path)
    inputs, _ = _inputs(spec, pipe, 16, 16, torch.Generator().manual_seed(2))
    outputs = []
    for weight_name in ("pytorch_lora_weights.safetensors", COMFYUI_FILE):
        p = spec._pipeline(None, text=False)
        p.load_lora_weights(str(tmp_path), weight_name=weight_name)
        with torch.no_grad():
            outputs.append(spec.denoiser_forward(p.transformer, inputs))
    with torch.no_grad():
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
    assert (outputs[0] - base).abs().max() > 1e-4
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)


def test_lora_targets_cover_every_block_linear(tiny):
    transformer = _spec(tiny).load_denoiser(torch.float32)
    pattern = re.compile(LORA_TARGETS)
    linears = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    in_blocks = [n for n in linears if "_stream_blocks." in n]
    assert in_blocks and all(pattern.fullmatch(n) for n in in_blocks)
    assert not any(pattern.fullmatch(n) for n in set(linears) - set(in_blocks))


def test_layer_costs_are_the_layers_flops(tiny, pipe):
    """The modelled FLOPs that balance HiDream's stages are what torch counts in each layer, the
    MoE's routed experts (each token visits 2 of 4) and the joint attention included; the
    default parameter counts are far from them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dpipe.models.hidream.costs import layer_forward_flops
    from dpipe.models.spec import ModelSpec
    from tests.unit.video_checks import layer_flops

    spec = _spec(tiny)
    inputs, _ = _inputs(spec, pipe, 16, 16, torch.Generator().manual_seed(0))
    layers = spec.pipeline_layers(spec.load_denoiser(torch.float32))
    with sdpa_kernel(SDPBackend.MATH):  # attention as matmuls, which the counter counts
        counted = [flops / inputs[0].shape[0] for flops in layer_flops(layers, inputs)]
    image_tokens = inputs[0].shape[-2] * inputs[0].shape[-1] // 4  # 2x2 patches
    modelled = layer_forward_flops(layers, image_tokens, spec.cfg.max_text_tokens)
    assert modelled == pytest.approx(counted, rel=1e-6)
    params = ModelSpec.layer_costs(spec, layers)
    ratios = [p / f for p, f in zip(params[1:-1], counted[1:-1])]  # the blocks
    assert max(ratios) / min(ratios) > 1.5, "parameter counts would balance these blocks too"
