"""Block swap and activation offload on a GPU (skipped without CUDA): `pytest tests/gpu -k swap`.

Compiled layers with swapped frozen weights give the unswapped results within bf16's rounding,
do not recompile, and the peak memory drops by the swapped layers' bytes (less the two layers
in flight); then the tiny FLUX trains through `dpipe-train` with swap and offload.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpipe.pipeline.block_swap import BlockSwap
from dpipe.pipeline.engine import forward_layers
from tests.cli import dpipe_train, metrics, train_args

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
WIDTH, LAYERS = 2048, 8


class Block(nn.Module):
    """A frozen bf16 Linear (8 MiB) with a trainable low-rank pair, on a stage tuple."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH, dtype=torch.bfloat16).requires_grad_(False)
        self.down = nn.Parameter(torch.randn(16, WIDTH) * 0.01)
        self.up = nn.Parameter(torch.randn(WIDTH, 16) * 0.01)

    def forward(self, x):
        h, ids = x
        return h + torch.tanh(self.base(h) + h @ self.down.t() @ self.up.t()), ids


def _layers(device):
    torch.manual_seed(0)
    layers = [Block() for _ in range(LAYERS)]
    for layer in layers:
        layer.compile()
    return layers


def _step(layers, device, swap=None, checkpointed=(), offload=False):
    torch.manual_seed(1)
    h = torch.randn(256, WIDTH, device=device)
    ids = torch.arange(256, device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = forward_layers(layers, (h, ids), set(checkpointed), offload, swap)
    out.float().square().mean().backward()
    if swap is not None:
        swap.end_pass()
    return out.detach().float(), [p.grad.float().clone() for layer in layers
                                  for p in (layer.down, layer.up)]


@pytest.mark.parametrize("checkpointing", ["none", "all", "offload"])
def test_swap_on_compiled_layers_matches_and_lowers_the_peak(checkpointing):
    import torch._dynamo

    device = torch.device("cuda")
    checkpointed = () if checkpointing == "none" else range(LAYERS)
    offload = checkpointing == "offload"
    torch._dynamo.reset()
    plain = [layer.to(device) for layer in _layers(device)]
    _step(plain, device, None, checkpointed, offload)  # compiles
    for layer in plain:
        layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    want = _step(plain, device, None, checkpointed, offload)
    plain_peak = torch.cuda.max_memory_allocated() - start
    del plain
    torch.cuda.empty_cache()

    layers = _layers(device)
    swapped = set(range(LAYERS))
    swap = BlockSwap(layers, swapped)
    for layer in layers:
        layer.to(device)  # as deepspeed.initialize moves the module: placeholders only
    swap.attach(device)
    block_bytes = swap.bytes[0]
    _step(layers, device, swap, checkpointed, offload)  # compiles for the swapped layers
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    got = _step(layers, device, swap, checkpointed, offload)
    swap_peak = torch.cuda.max_memory_allocated() - start + _resident_frozen(layers)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "recompiled"
    for a, b in zip((got[0], *got[1]), (want[0], *want[1])):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    # The unswapped peak counts every frozen weight, the swapped one at most two layers'.
    plain_total = plain_peak + LAYERS * block_bytes
    assert plain_total - swap_peak >= (len(swapped) - 2) * block_bytes, (
        plain_total, swap_peak, block_bytes)


def _resident_frozen(layers) -> int:
    return sum(p.numel() * p.element_size() for layer in layers for p in layer.base.parameters()
               if p.is_cuda)


def test_tiny_flux_trains_with_swap_and_offload_as_without(tmp_path):
    base = ["model=tiny_flux", "dataset=synthetic", "train.precision=bf16", "train.max_steps=2",
            "pipeline.micro_batches=4", "train.checkpoint_every_steps=0", "pipeline=single"]

    def losses(run_dir, *overrides):
        result = dpipe_train(*train_args(run_dir, *base, *overrides), timeout=600)
        assert result.code == 0, result.err[-3000:]
        return torch.tensor([m["loss"] for m in metrics(run_dir)])

    plain = losses(tmp_path / "plain")
    swapped = losses(tmp_path / "swap", "pipeline.blocks_to_swap=3",
                     "pipeline.activation_checkpointing=offload")
    torch.testing.assert_close(swapped, plain, rtol=2e-2, atol=1e-3)
