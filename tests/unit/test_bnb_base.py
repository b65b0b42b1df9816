"""bitsandbytes base weights for LoRA (`model.base_dtype=nf4|int8_bnb`): quantized by
bitsandbytes' own functions (they run on the CPU since 0.48), held quantized, and multiplied by
what bitsandbytes' own dequantization gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpipe.config.compose import compose_run
from dpipe.errors import ConfigError
from dpipe.train.bnb_base import NF4Linear, int8_bnb_linear
from dpipe.train.fp8 import QuantizedLinear
from tests.unit.test_fp8_base import BASE


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(256, 64).requires_grad_(False)
    linear.weight.mul_(torch.logspace(-2, 1, 64)[:, None])  # rows of very different magnitude
    return linear


def test_nf4_is_bitsandbytes_nf4_and_multiplies_by_its_dequantization():
    import bitsandbytes.functional as bnb

    linear = _linear()
    module = NF4Linear(linear)
    packed, state = bnb.quantize_4bit(linear.weight, blocksize=64, quant_type="nf4")
    assert module.weight.dtype == torch.uint8 and torch.equal(module.weight, packed)
    theirs = bnb.dequantize_4bit(packed, state)
    assert torch.equal(module.dequantized(), theirs)
    assert module.weight.numel() + 4 * module.absmax.numel() == 64 * 256 * (0.5 + 4 / 64)

    x = torch.randn(8, 256, requires_grad=True)
    y = module(x)
    y.square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = nn.functional.linear(x_ref, theirs, linear.bias)
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    assert not module.weight.requires_grad and module.weight.grad is None


# Compiling on the CPU takes 10-16 s on this 2-core machine: slow.
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["eager", "compiled"])
def test_backward_keeps_the_4_bit_codes_not_a_dequantized_copy(compiled):
    """Also inside torch.compile, where an autograd.Function had its dequantized weight saved."""
    import shutil

    if compiled and not shutil.which("cc"):
        pytest.skip("torch.compile on CPU needs a C compiler")
    module = NF4Linear(_linear().to(torch.bfloat16))
    model = torch.compile(module) if compiled else module
    x = torch.randn(8, 256, requires_grad=True)
    model(x)  # compiles
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = model(x)
    assert sorted(t.dtype for t in saved if t.dim() == 2) == [torch.uint8], [
        (t.dtype, tuple(t.shape)) for t in saved]  # the codes; absmax and code book are vectors
    y.float().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    nn.functional.linear(x_ref.bfloat16(), module.dequantized().bfloat16(),
                         module.bias).float().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-2, atol=1e-2)


def test_int8_bnb_is_llm_int8s_rows_and_scales():
    import bitsandbytes.functional as bnb

    linear = _linear()
    module = int8_bnb_linear(linear)
    rows, stats, _ = bnb.int8_vectorwise_quant(linear.weight.to(torch.float16))
    assert isinstance(module, QuantizedLinear) and torch.equal(module.weight, rows)
    torch.testing.assert_close(module.dequantized(),
                               bnb.int8_vectorwise_dequant(rows, stats).float(),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("base_dtype", ["nf4", "int8_bnb"])
def test_a_full_fine_tune_on_a_bnb_base_is_refused(base_dtype):
    with pytest.raises(ConfigError, match=f"model.base_dtype={base_dtype}.*model.mode=full"):
        compose_run([*BASE, f"model.base_dtype={base_dtype}", "model.mode=full",
                     "optim.master_weights=false"])
