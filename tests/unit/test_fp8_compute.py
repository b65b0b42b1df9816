"""`model.base_compute=fp8` (dpipe.train.fp8_compute) on the CPU: the row quantisation, the fp8
matmul and its input gradient against the same math done in fp32, the module swap, and the
config checks. torch's CPU `_scaled_mm` runs the same op as the GPU's (slowly)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dpipe.config.checks import validate
from dpipe.errors import ConfigError
from dpipe.train.fp8 import QuantizedLinear
from dpipe.train.fp8_compute import (E4M3, E5M2, Fp8Linear, fp8_linear, quantize_rows,
                                     use_fp8_compute)
from tests.unit.test_config import _compose


def test_rows_quantise_to_the_format_top_with_one_scale_each():
    x = torch.tensor([[1.0, -2.0, 0.5], [1000.0, 3.0, -7.0]])
    q, scale = quantize_rows(x, E4M3)
    assert q.dtype == E4M3 and scale.shape == (2, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale[:, 0], torch.tensor([2.0, 1000.0]) / 448)
    # Each row's largest magnitude lands on 448 exactly; the rest within e4m3's rounding.
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 448.0]
    torch.testing.assert_close(q.float() * scale, x, rtol=2 ** -4, atol=0)


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
    """x @ W^T with x rounded per row to e4m3 and the stored fp8 weight, in fp32."""
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = (xq.float() * xs) @ q.dequantized().t()
    return y.view(*x.shape[:-1], -1)


def test_the_fp8_matmul_is_the_quantised_product_and_close_to_fp32():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).requires_grad_(False)
    fp8 = Fp8Linear(linear)
    x = torch.randn(2, 7, 64)
    y = fp8(x)
    assert y.shape == (2, 7, 48) and y.dtype == torch.float32
    torch.testing.assert_close(y, _reference(x, fp8) + linear.bias, rtol=1e-5, atol=1e-5)
    err = ((y - linear(x)).norm() / linear(x).norm()).item()
    assert 1e-3 < err < 6e-2, err  # e4m3 weights and activations: a few percent, not exact


@pytest.mark.parametrize("grad_format", [E4M3, E5M2, None], ids=["e4m3", "e5m2", "bf16"])
def test_backward_gives_the_input_gradient_only(grad_format):
    torch.manual_seed(1)
    linear = nn.Linear(32, 64, bias=False).requires_grad_(False)
    q = QuantizedLinear(linear)
    x = torch.randn(5, 32, requires_grad=True)
    g = torch.randn(5, 64)
    fp8_linear(x, q.weight, q.scale, torch.float32, grad_format).backward(g)
    exact = g @ q.dequantized()
    err = ((x.grad - exact).norm() / exact.norm()).item()
    limit = {E4M3: 4e-2, E5M2: 8e-2, None: 1e-6}[grad_format]
    assert err < limit, err
    if grad_format is not None:  # the gradient was really rounded to the format
        assert err > 1e-4
    assert q.weight.grad is None


def test_bf16_autocast_runs_in_bf16_and_keeps_the_input_dtype_for_its_gradient():
    fp8 = Fp8Linear(nn.Linear(32, 32).requires_grad_(False))
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


def test_the_swap_uses_fp8_where_the_shapes_allow(caplog):
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 24)),
                            nn.Sequential(nn.Linear(32, 32))])
    head = nn.Linear(32, 32)
    model = nn.ModuleDict({"blocks": blocks, "head": head}).requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="dpipe"):
        assert use_fp8_compute(model) == 2
    assert type(blocks[0][0]) is Fp8Linear and type(blocks[1][0]) is Fp8Linear
    assert type(blocks[0][1]) is QuantizedLinear  # 24 outputs: not divisible by 16
    assert type(model["head"]) is nn.Linear  # outside the blocks
    assert "2 frozen Linears multiply in fp8; 1 with a dimension not divisible by 16" in caplog.text


def test_a_compiled_fp8_linear_equals_eager():
    torch.manual_seed(2)
    fp8 = Fp8Linear(nn.Linear(32, 32).requires_grad_(False))
    x = torch.randn(8, 32, requires_grad=True)
    g = torch.randn(8, 32)
    y = fp8(x)
    y.backward(g)
    eager_grad = x.grad.clone()
    x.grad = None
    compiled = torch.compile(fp8)
    yc = compiled(x)
    yc.backward(g)
    torch.testing.assert_close(yc, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, eager_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, says", [
    (["model.mode=full"], "model.mode=full trains every weight"),
    (["model.base_dtype=int8"], "model.base_dtype=int8 asks for another storage"),
    (["model.adapter=dora"], "model.base_compute=fp8 stores scaled per row"),
])
def test_combinations_fp8_compute_cannot_train_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        validate(_compose(["model.base_compute=fp8", *overrides]))


def test_fp8_compute_with_fp8_storage_is_accepted():
    run = validate(_compose(["model.base_compute=fp8", "model.base_dtype=fp8"]))
    assert run.model.base_compute.value == "fp8"
