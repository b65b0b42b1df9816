"""`model.base_compute=fp8|int8` (dpipe.train.fp8_compute, dpipe.train.int8_compute) on the CPU:
the row quantisation, each format's matmul and its input gradient against the same math in fp32,
int8's bf16 fallback for the shapes cuBLAS's int8 kernel refuses, the module swap, the GPUs each
format runs on, the config checks, and the tiny FLUX.1 model's forward and LoRA gradients in int8
against bf16. torch's CPU `_scaled_mm` and `_int_mm` run the GPU's ops (`_int_mm` sums int8
products in int32 exactly as the GPU's)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpipe.config.checks import validate
from dpipe.errors import ConfigError
from dpipe.train.fp8 import QuantizedLinear, capability_short_of
from dpipe.train.fp8_compute import (E4M3, E5M2, Fp8Linear, fp8_linear, quantize_rows,
                                     use_fp8_compute)
from dpipe.train.int8_compute import INT8, Int8Linear, int8_linear, use_int8_compute
from tests.unit.test_config import _compose


@dataclass(frozen=True)
class Format:
    linear: type  # the Linear that multiplies in the format
    matmul: Callable  # its product: (x, weight, scale, out dtype, backward's variant)
    use: Callable  # the blocks' swap
    storage: torch.dtype
    align: int  # both dimensions of a Linear that multiplies in the format divide by it
    out_error: float  # above the output's relative error against fp32
    backend: str  # torch.compile's, for the compiled-equals-eager check


# int8's `_int_mm` on CUDA takes more than 16 rows: its checks use 17 or more. fp8's compiled
# check traces as int8's does (aot_eager: Dynamo and AOTAutograd trace the autograd.Function as a
# compiled block does); inductor's kernels for both run in tests/gpu/test_base_compute_gpu.py
# (pipeline.compile).
FORMATS = {"fp8": Format(Fp8Linear, fp8_linear, use_fp8_compute, E4M3, 16, 6e-2, "aot_eager"),
           "int8": Format(Int8Linear, int8_linear, use_int8_compute, INT8, 8, 2e-2, "aot_eager")}


def test_rows_quantise_to_the_format_top_with_one_scale_each():
    x = torch.tensor([[1.0, -2.0, 0.5], [1000.0, 3.0, -7.0]])
    q, scale = quantize_rows(x, E4M3)
    assert q.dtype == E4M3 and scale.shape == (2, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale[:, 0], torch.tensor([2.0, 1000.0]) / 448)
    # Each row's largest magnitude lands on 448 exactly; the rest within e4m3's rounding.
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 448.0]
    torch.testing.assert_close(q.float() * scale, x, rtol=2 ** -4, atol=0)


def test_rows_quantise_to_127_rounded_to_the_nearest_step():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [254.0, 3.0, -7.0, 1.0]])
    q, scale = quantize_rows(x, INT8)
    assert q.dtype == INT8 and scale.shape == (2, 1)
    assert q.tolist() == [[64, -127, 32, 0], [127, 2, -4, 0]]  # 63.5 and 1.5 round to even
    q, scale = quantize_rows(torch.zeros(2, 8), INT8)
    assert (q == 0).all() and torch.isfinite(scale).all()


def test_zero_rows_give_zeros_and_outliers_do_not_overflow():
    x = torch.zeros(3, 32)
    x[1, 0] = 3e38  # near fp32's top: the scale takes it, the row saturates to 448, not inf
    x[2] = torch.linspace(-1, 1, 32)
    for fmt in (E4M3, E5M2):
        q, scale = quantize_rows(x, fmt)
        assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all()
        assert (q[0].float() == 0).all()
        assert q[1, 0].float() == torch.finfo(fmt).max
    # A non-finite input stays visible: its row's scale is not finite.
    _, scale = quantize_rows(torch.tensor([[1.0, float("inf")]]))
    assert not torch.isfinite(scale).all()


def _reference(x, q: QuantizedLinear):
    """x @ W^T with x rounded per row to the weight's format and the stored weight, in fp32."""
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]), q.weight.dtype)
    return ((xq.float() * xs) @ q.dequantized().t()).view(*x.shape[:-1], -1)


@pytest.mark.parametrize("compute", FORMATS)
def test_the_matmul_is_the_quantised_product_and_close_to_fp32(compute):
    fmt = FORMATS[compute]
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).requires_grad_(False)
    fast = fmt.linear(linear)
    x = torch.randn(2, 17, 64)
    y = fast(x)
    assert y.shape == (2, 17, 48) and y.dtype == torch.float32
    torch.testing.assert_close(y, _reference(x, fast) + linear.bias, rtol=1e-5, atol=1e-5)
    err = ((y - linear(x)).norm() / linear(x).norm()).item()
    assert 1e-3 < err < fmt.out_error, err  # 8-bit weights and activations: not exact


@pytest.mark.parametrize("compute, variant, limit", [
    ("fp8", E4M3, 4e-2), ("fp8", E5M2, 8e-2), ("fp8", None, 1e-6),
    ("int8", True, 2e-2), ("int8", False, 1e-6)],
    ids=["fp8-e4m3", "fp8-e5m2", "fp8-bf16", "int8-int8", "int8-bf16"])
def test_backward_gives_the_input_gradient_only(compute, variant, limit):
    """The input's gradient, its (grad * s) @ W8 in the format's variant (fp8: GRAD_FORMAT e4m3
    or e5m2, int8: INT8_GRAD) or in the compute dtype, against fp32's."""
    fmt = FORMATS[compute]
    torch.manual_seed(1)
    q = QuantizedLinear(nn.Linear(32, 64, bias=False).requires_grad_(False), fmt.storage)
    x = torch.randn(2, 17, 32, requires_grad=True)
    g = torch.randn(2, 17, 64)
    fmt.matmul(x, q.weight, q.scale, torch.float32, variant).backward(g)
    exact = g @ q.dequantized()
    err = ((x.grad - exact).norm() / exact.norm()).item()
    assert err < limit, err
    if variant not in (None, False):  # the gradient was really rounded to the format
        assert err > 1e-4
    assert q.weight.grad is None


def test_few_rows_multiply_in_bf16_as_int8_storage_does():
    """cuBLAS's int8 kernel takes more than 16 rows: a modulation Linear's one row per sample
    multiplies the int8 weights in the compute dtype."""
    torch.manual_seed(1)
    linear = nn.Linear(32, 64).requires_grad_(False)
    int8, stored = Int8Linear(linear), QuantizedLinear(linear, INT8)
    x = torch.randn(2, 8, 32)
    assert torch.equal(int8(x), stored(x))
    assert not torch.equal(int8(x.repeat(1, 3, 1))[:, :8], stored(x))


@pytest.mark.parametrize("compute", FORMATS)
def test_bf16_autocast_runs_in_bf16_and_keeps_the_input_dtype_for_its_gradient(compute):
    fast = FORMATS[compute].linear(nn.Linear(32, 32).requires_grad_(False))
    x = torch.randn(20, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fast(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("compute", FORMATS)
def test_the_swap_uses_the_format_where_the_shapes_allow(compute, caplog):
    fmt = FORMATS[compute]
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 20)),
                            nn.Sequential(nn.Linear(32, 32))])
    model = nn.ModuleDict({"blocks": blocks, "head": nn.Linear(32, 32)}).requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="dpipe"):
        assert fmt.use(model) == 2
    assert type(blocks[0][0]) is fmt.linear and type(blocks[1][0]) is fmt.linear
    # 20 outputs divide by neither 16 nor 8: 8-bit weights, multiplied in bf16
    assert type(blocks[0][1]) is QuantizedLinear and blocks[0][1].storage == fmt.storage
    assert type(model["head"]) is nn.Linear  # outside the blocks
    assert (f"model.base_compute={compute}: 2 frozen Linears multiply in {compute}; 1 with a "
            f"dimension not divisible by {fmt.align} keep {compute} weights") in caplog.text


@pytest.mark.parametrize("compute, capability, says", [
    ("fp8", (9, 0), None), ("fp8", (8, 9), None), ("int8", (8, 0), None),
    ("fp8", (8, 6), "GPU (compute capability 8.6) has no fp8 matmul: it needs 8.9 or newer"),
    ("int8", (7, 5), "GPU (compute capability 7.5) has no int8 matmul: it needs 8.0 or newer")])
def test_each_format_names_the_gpus_it_runs_on(compute, capability, says):
    why = capability_short_of(compute, capability, "GPU")
    assert why == says if says is None else says in why


@pytest.mark.parametrize("compute", FORMATS)
def test_a_compiled_linear_equals_eager(compute):
    fmt = FORMATS[compute]
    torch.manual_seed(2)
    fast = fmt.linear(nn.Linear(32, 32).requires_grad_(False))
    x = torch.randn(24, 32, requires_grad=True)
    g = torch.randn(24, 32)
    y = fast(x)
    y.backward(g)
    eager_grad = x.grad.clone()
    x.grad = None
    yc = torch.compile(fast, backend=fmt.backend)(x)
    yc.backward(g)
    torch.testing.assert_close(yc, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, eager_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compute, overrides, says", [
    ("fp8", ["model.mode=full"], "model.mode=full trains every weight"),
    ("fp8", ["model.base_dtype=int8"], "model.base_dtype=int8 asks for another storage"),
    ("fp8", ["model.adapter=dora"], "model.base_compute=fp8 stores scaled per row"),
    ("int8", ["model.mode=full"],
     "model.base_compute=int8 multiplies the frozen base weights of a LoRA"),
    ("int8", ["model.base_dtype=fp8"], "multiplies int8 weights, but model.base_dtype=fp8 asks"),
    ("int8", ["model.base_dtype=nf4"], "model.base_dtype=nf4 asks for another storage"),
    ("int8", ["model.adapter=dora"], "model.base_compute=int8 stores scaled per row"),
])
def test_combinations_the_format_cannot_train_are_refused(compute, overrides, says):
    with pytest.raises(ConfigError, match=says):
        validate(_compose([f"model.base_compute={compute}", *overrides]))


@pytest.mark.parametrize("compute", FORMATS)
def test_the_format_with_its_own_storage_is_accepted(compute):
    run = validate(_compose([f"model.base_compute={compute}", f"model.base_dtype={compute}"]))
    assert run.model.base_compute.value == compute


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
