"""`model.base_compute=int8` (dpipe.train.int8_compute) on the CPU: the int8 matmul and its input
gradient against the same math in fp32, the bf16 fallbacks for the shapes cuBLAS's int8 kernel
refuses, the module swap, the config checks, and the tiny FLUX.1 model's forward and LoRA
gradients against bf16. torch's CPU `_int_mm` sums int8 products in int32 exactly as the GPU's."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpipe.config.checks import validate
from dpipe.errors import ConfigError
from dpipe.train.fp8 import QuantizedLinear
from dpipe.train.fp8_compute import quantize_rows
from dpipe.train.int8_compute import INT8, Int8Linear, int8_linear, use_int8_compute
from tests.unit.test_config import _compose


def test_rows_quantise_to_127_rounded_to_the_nearest_step():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [254.0, 3.0, -7.0, 1.0]])
    q, scale = quantize_rows(x, INT8)
    assert q.dtype == INT8 and scale.shape == (2, 1)
    assert q.tolist() == [[64, -127, 32, 0], [127, 2, -4, 0]]  # 63.5 and 1.5 round to even
    q, scale = quantize_rows(torch.zeros(2, 8), INT8)
    assert (q == 0).all() and torch.isfinite(scale).all()


def _reference(x, q: QuantizedLinear):
    """x @ W^T with x rounded per row to int8 and the stored int8 weight, in fp32."""
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]), INT8)
    return ((xq.float() * xs) @ q.dequantized().t()).view(*x.shape[:-1], -1)


def test_the_int8_matmul_is_the_quantised_product_and_its_gradient_is_close():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).requires_grad_(False)
    int8 = Int8Linear(linear)
    x = torch.randn(2, 17, 64, requires_grad=True)
    y = int8(x)
    assert y.shape == (2, 17, 48) and y.dtype == torch.float32
    torch.testing.assert_close(y, _reference(x, int8) + linear.bias, rtol=1e-5, atol=1e-5)
    err = ((y - linear(x)).norm() / linear(x).norm()).item()
    assert 1e-3 < err < 2e-2, err  # int8 weights and activations: about 1%, not exact
    g = torch.randn(2, 17, 48)
    y.backward(g)
    exact = g @ int8.dequantized()
    err = ((x.grad - exact).norm() / exact.norm()).item()
    assert 1e-4 < err < 2e-2, err  # the gradient really was rounded to int8
    assert int8.weight.grad is None
    x.grad = None
    int8_linear(x, int8.weight, int8.scale, torch.float32, int8_grad=False).backward(g)
    torch.testing.assert_close(x.grad, exact, rtol=1e-5, atol=1e-5)


def test_few_rows_multiply_in_bf16_as_int8_storage_does():
    """cuBLAS's int8 kernel takes more than 16 rows: a modulation Linear's one row per sample
    multiplies the int8 weights in the compute dtype."""
    torch.manual_seed(1)
    linear = nn.Linear(32, 64).requires_grad_(False)
    int8, stored = Int8Linear(linear), QuantizedLinear(linear, INT8)
    x = torch.randn(2, 8, 32)
    assert torch.equal(int8(x), stored(x))
    assert not torch.equal(int8(x.repeat(1, 3, 1))[:, :8], stored(x))


def test_bf16_autocast_runs_in_bf16_and_keeps_the_input_dtype_for_its_gradient():
    int8 = Int8Linear(nn.Linear(32, 32).requires_grad_(False))
    x = torch.randn(20, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = int8(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


def test_the_swap_uses_int8_where_the_shapes_allow(caplog):
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 20))])
    model = nn.ModuleDict({"blocks": blocks, "head": nn.Linear(32, 32)}).requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="dpipe"):
        assert use_int8_compute(model) == 1
    assert type(blocks[0][0]) is Int8Linear
    assert type(blocks[0][1]) is QuantizedLinear and blocks[0][1].storage == INT8  # 20 outputs
    assert type(model["head"]) is nn.Linear  # outside the blocks
    assert ("model.base_compute=int8: 1 frozen Linears multiply in int8; 1 with a dimension not "
            "divisible by 8 keep int8 weights") in caplog.text


def test_a_compiled_int8_linear_equals_eager():
    torch.manual_seed(2)
    int8 = Int8Linear(nn.Linear(32, 32).requires_grad_(False))
    x = torch.randn(24, 32, requires_grad=True)
    g = torch.randn(24, 32)
    y = int8(x)
    y.backward(g)
    eager_grad = x.grad.clone()
    x.grad = None
    # aot_eager: Dynamo and AOTAutograd trace the autograd.Function as a compiled block does;
    # inductor's kernels for it are run by tests/gpu/test_int8_compute_gpu.py (pipeline.compile).
    yc = torch.compile(int8, backend="aot_eager")(x)
    yc.backward(g)
    torch.testing.assert_close(yc, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, eager_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, says", [
    (["model.mode=full"], "model.base_compute=int8 multiplies the frozen base weights of a LoRA"),
    (["model.base_dtype=fp8"], "multiplies int8 weights, but model.base_dtype=fp8 asks for"),
    (["model.base_dtype=nf4"], "model.base_dtype=nf4 asks for another storage"),
    (["model.adapter=dora"], "model.base_compute=int8 stores scaled per row"),
])
def test_combinations_int8_compute_cannot_train_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        validate(_compose(["model.base_compute=int8", *overrides]))


def test_int8_compute_with_int8_storage_is_accepted():
    run = validate(_compose(["model.base_compute=int8", "model.base_dtype=int8"]))
    assert run.model.base_compute.value == "int8"


def _tiny_flux_step(base_compute: str):
    """The tiny FLUX.1 model's output and LoRA gradients for one micro-batch of two samples in
    bf16, its layers built as training builds them; lora_B made non-zero (peft's zero init gives
    every lora_A a zero gradient, and two zero vectors no cosine)."""
    from dpipe.bench.worker import fixed_micro_batches
    from dpipe.models.registry import build_spec
    from dpipe.train.trainable import trainable_layers

    run = validate(_compose(["model=tiny_flux", "train.precision=bf16",
                             f"model.base_compute={base_compute}"]))
    spec = build_spec(run.model)
    spec.ensure_available()
    layers = trainable_layers(spec, run)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in layers:
            for name, p in layer.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    inputs, labels = fixed_micro_batches(spec, "tiny", 1, 2, seed=0)[0]
    x = inputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for layer in layers:
            x = layer(x)
        spec.loss(x, labels).backward()
    out = x if isinstance(x, torch.Tensor) else x[0]
    grads = {f"{i}.{n}": p.grad.float() for i, layer in enumerate(layers)
             for n, p in layer.named_parameters() if p.grad is not None}
    return out.float(), grads, layers


def test_tiny_flux_forward_and_lora_gradients_align_with_bf16_per_parameter():
    out16, grads16, _ = _tiny_flux_step("auto")
    out8, grads8, layers = _tiny_flux_step("int8")
    assert any(isinstance(m, Int8Linear) for layer in layers for m in layer.modules())
    assert F.cosine_similarity(out8.flatten(), out16.flatten(), dim=0) >= 0.99
    assert grads8.keys() == grads16.keys() and len(grads16) > 20
    for name, g in grads16.items():
        assert g.norm() > 0, name
        cos = F.cosine_similarity(grads8[name].flatten(), g.flatten(), dim=0).item()
        assert cos >= 0.99, (name, cos)
