"""The tiny HiDream-I1: loads (with Llama from text_encoder_4/) and generates with diffusers;
pipeline layers reproduce the MoE transformer for square and padded non-square latents, in
training mode with gradients through the experts; dpipe's sync-free MoE gives diffusers' outputs
and gradients; the ComfyUI LoRA file loads like the diffusers
one; the target has HiDream's sign."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

from dpipe.config.schema import LoraConfig, ModelConfig
from dpipe.errors import ModelLoadError
from dpipe.models.hidream.moe import SyncFreeMoE
from dpipe.models.hidream.spec import COMFYUI_FILE, HiDreamSpec
from dpipe.train.lora import make_trainable
from tests.exports import export_lora

PROMPTS = ["a red circle on a blue background", "a photo of two green stars"]


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
    diffusers_own = copy.deepcopy(transformer)  # the layers give the copy's MoE dpipe's forward
    layers = spec.pipeline_layers(transformer)
    assert type(diffusers_own.double_stream_blocks[0].block.ff_i) is MOEFeedForwardSwiGLU
    for train in (False, True):  # diffusers' inference and training MoE paths
        transformer.train(train)
        diffusers_own.train(train)
        x = inputs
        for layer in layers:
            x = layer(x)
            assert all(t.is_contiguous() for t in (x if isinstance(x, tuple) else (x,)))
        with torch.no_grad():
            expected = spec.denoiser_forward(diffusers_own, inputs)
        torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)
    spec.loss(x, labels).backward()
    expert_grads = [p.grad for n, p in transformer.named_parameters()
                    if "lora_" in n and ".experts." in n]
    assert expert_grads and all(g is not None for g in expert_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_free_moe_is_diffusers_moe(dtype):
    """Output and every gradient (the input's, the gate's, the experts' LoRA) as diffusers'
    training path gives them; the output bit for bit in float32, where an unselected expert adds
    an exact zero (the gradients sum the same terms in another order)."""
    torch.manual_seed(0)
    theirs = MOEFeedForwardSwiGLU(dim=32, hidden_dim=48, num_routed_experts=4,
                                  num_activated_experts=2).to(dtype).train()
    make_trainable(theirs, ModelConfig(family="hidream", lora=LoraConfig(rank=4, alpha=2)),
                   r"experts\.\d+\.w[123]")
    theirs.gate.weight.requires_grad_(True)  # the routing weights' gradient path too
    for name, p in theirs.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    ours = copy.deepcopy(theirs)
    ours.__class__ = SyncFreeMoE
    x = torch.randn(2, 24, 32, dtype=dtype)
    results = []
    for moe in (theirs, ours):
        xi = x.clone().requires_grad_()
        y = moe(xi)
        (y.float() * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
        grads = {n: p.grad for n, p in moe.named_parameters() if p.requires_grad}
        results.append((y, xi.grad, grads))
    (y0, gx0, g0), (y1, gx1, g1) = results
    assert len(g0) == 4 * 3 * 2 + 1 and all(g is not None for g in g0.values())
    exact = dict(rtol=0, atol=0) if dtype == torch.float32 else {}
    torch.testing.assert_close(y1, y0, **exact)
    # bfloat16 sums in another order round differently: a few ulps of values near 1.
    close = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=4e-3)
    torch.testing.assert_close(gx1, gx0, **close)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], **close, msg=name)


def test_comfyui_lora_loads_like_the_diffusers_file(tiny, pipe, tmp_path):
    spec = _spec(tiny)
    transformer = spec.load_denoiser(torch.float32)
    make_trainable(transformer, spec.cfg, spec.lora_targets())
    gen = torch.Generator().manual_seed(1)
    lora = {n: torch.randn(p.shape, generator=gen) * 0.05
            for n, p in transformer.named_parameters() if "lora_" in n}
    export_lora(spec, lora, tmp_path)
    inputs, _ = _inputs(spec, pipe, 16, 16, torch.Generator().manual_seed(2))
    outputs = []
    # The ComfyUI file alone in a folder, under the diffusers file's name: loaded the same way.
    comfy_dir = tmp_path / "comfyui"
    comfy_dir.mkdir()
    (tmp_path / COMFYUI_FILE).rename(comfy_dir / "pytorch_lora_weights.safetensors")
    for lora_dir in (tmp_path, comfy_dir):
        transformer = spec.load_denoiser_with_lora(lora_dir)
        with torch.no_grad():
            outputs.append(spec.denoiser_forward(transformer, inputs))
    with torch.no_grad():
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
    assert (outputs[0] - base).abs().max() > 1e-4
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)


def test_layer_costs_are_the_layers_flops(tiny, pipe):
    """The modelled FLOPs that balance HiDream's stages are what torch counts in each layer, the
    MoE's routed experts (dpipe's sync-free MoE runs each on every token) and the joint
    attention included; the model FLOPs (a token visits 2 of 4 experts) are fewer; the default
    parameter counts are far from them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dpipe.models.hidream.costs import attention_flops, layer_forward_flops, weight_flops
    from dpipe.models.spec import ModelSpec, counted_layer_flops

    spec = _spec(tiny)
    inputs, _ = _inputs(spec, pipe, 16, 16, torch.Generator().manual_seed(0))
    layers = spec.pipeline_layers(spec.load_denoiser(torch.float32))
    with sdpa_kernel(SDPBackend.MATH):  # attention as matmuls, which the counter counts
        counted = [flops / inputs[0].shape[0]
                   for flops in counted_layer_flops(layers, inputs, fake=False)]
    image_tokens = inputs[0].shape[-2] * inputs[0].shape[-1] // 4  # 2x2 patches
    modelled = layer_forward_flops(layers, image_tokens, spec.cfg.max_text_tokens)
    assert modelled == pytest.approx(counted, rel=1e-6)
    model = [weight_flops(layer, image_tokens, spec.cfg.max_text_tokens, executed=False)
             + attention_flops(layer, image_tokens, spec.cfg.max_text_tokens) for layer in layers]
    assert model[0] == modelled[0] and model[-1] == modelled[-1]  # no MoE in embed and head
    assert all(m < e for m, e in zip(model[1:-1], modelled[1:-1]))
    params = ModelSpec.layer_costs(spec, layers)
    ratios = [p / f for p, f in zip(params[1:-1], counted[1:-1])]  # the blocks
    assert max(ratios) / min(ratios) > 1.5, "parameter counts would balance these blocks too"
