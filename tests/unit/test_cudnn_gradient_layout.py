"""With model.attention=cudnn, SDPA's backward gets its output's gradient in the output's layout.

cuDNN's backward reads out of bounds on a gradient laid out otherwise (compute-sanitizer on an
H200: docs/bench-results/h200-1gpu-cudnn-nan). The wrapper that prevents it runs on any device;
here it is checked on the CPU with the very gradient FLUX's single blocks make: the slice of a
concatenation (attention output beside the MLP's), through diffusers' (B, S, H, D) transpose.
"""

from __future__ import annotations

import torch

from dpipe.pipeline import attention


def _flux_single_block_like(sdpa):
    """q, k, v as diffusers lays them out ((B, S, H, D) transposed), the attention's output
    concatenated with another branch and projected. Returns q, SDPA's output, and the strides
    of the gradient SDPA's backward receives."""
    torch.manual_seed(0)
    b, s, h, d = 2, 24, 3, 8
    q, k, v = (torch.randn(b, s, h, d).transpose(1, 2).requires_grad_() for _ in range(3))
    mlp = torch.randn(b, s, 40)
    out = sdpa(q, k, v)
    received = []
    out.register_hook(lambda g: received.append(g.stride()))  # runs after the wrapper's hook
    merged = torch.cat([out.transpose(1, 2).flatten(2, 3), mlp], dim=2)
    (merged @ torch.randn(merged.shape[-1], 5)).square().sum().backward()
    return q, out, received[0]


def test_the_gradient_reaches_sdpa_in_its_output_layout(monkeypatch):
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention
    q_plain, out_plain, plain_layout = _flux_single_block_like(torch_sdpa)
    assert plain_layout != out_plain.stride()  # the case cuDNN mishandles: a strided slice

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", torch_sdpa)
    attention._lay_out_gradients_for_cudnn()
    attention._lay_out_gradients_for_cudnn()  # once only: a second call must not wrap twice
    wrapped = torch.nn.functional.scaled_dot_product_attention
    assert wrapped is not torch_sdpa and wrapped.__wrapped__ is torch_sdpa

    q, out, layout = _flux_single_block_like(wrapped)
    assert layout == out.stride()
    torch.testing.assert_close(q.grad, q_plain.grad, rtol=0, atol=0)


def test_a_gradient_already_in_the_output_layout_is_not_copied():
    grad = torch.randn(2, 3, 4, 5).transpose(1, 2)
    assert attention._gradient_like_output(grad, grad.stride()) is grad
    dense = attention._gradient_like_output(grad, (60, 15, 5, 1))
    assert dense.stride() == (60, 15, 5, 1)
    torch.testing.assert_close(dense, grad, rtol=0, atol=0)
