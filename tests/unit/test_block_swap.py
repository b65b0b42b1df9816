"""Block swap and activation offload (dpipe.pipeline.block_swap, recompute.offloaded), on the CPU.

The layers pass a stage tuple (a float stream and integer ids) as dpipe's pipeline layers do;
each holds a frozen Linear, a frozen buffer and a trainable LoRA-like pair. The swap parks the
frozen tensors as NaN here, so that a layer that ran, or backpropagated, or recomputed on weights
that were not copied in would give NaN instead of reading the host copy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpipe.pipeline.block_swap import BlockSwap, first_swappable, swappable
from dpipe.pipeline.engine import forward_layers
from dpipe.pipeline.recompute import offloaded

WIDTH = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.register_buffer("scale", torch.rand(WIDTH) + 0.5)
        self.down = nn.Parameter(torch.randn(2, WIDTH) * 0.1)
        self.up = nn.Parameter(torch.randn(WIDTH, 2) * 0.1)
        self.seen: list[int] = []  # data pointers of the base weight each call ran on

    def forward(self, x):
        h, ids = x
        self.seen.append(self.base.weight.data_ptr())
        y = self.base(h) * self.scale + h @ self.down.t() @ self.up.t()
        return torch.tanh(y) + ids.float().unsqueeze(-1) * 1e-3, ids


class Embed(nn.Module):
    """A frozen first layer whose output is a new leaf (as dpipe's first stage makes it)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH).requires_grad_(False)

    def forward(self, x):
        h, ids = x
        return self.proj(h).detach().requires_grad_(), ids


def _layers():
    torch.manual_seed(0)
    return [Embed(), *[Block() for _ in range(4)]]


def _micro_batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, WIDTH, generator=g), torch.arange(3)) for _ in range(n)]


def _train(layers, checkpointed=(), offload=False, swap=None):
    """Two micro-batches forward, then both backward (as a pipeline stage's warm-up runs
    them); returns the outputs and the trainable gradients."""
    outs = [forward_layers(layers, x, set(checkpointed), offload, swap) for x in _micro_batches()]
    for k, (h, _) in enumerate(outs):
        (h.square().sum() * (k + 1)).backward()
        if swap is not None:
            swap.end_pass()
    grads = [p.grad.clone() for layer in layers for p in layer.parameters() if p.requires_grad]
    return [h.detach() for h, _ in outs], grads


@pytest.mark.parametrize("checkpointing", ["none", "all", "offload"])
def test_swapped_layers_run_on_copied_in_weights_and_train_bit_identically(checkpointing):
    plain_outs, plain_grads = _train(_layers())
    layers = _layers()
    swap = BlockSwap(layers, {0, 1, 2, 4}, poisoned=True)  # layer 3 stays resident
    swap.attach(torch.device("cpu"))
    host_ptrs = {h.data_ptr() for hs in swap.host.values() for h in hs}  # alive all along
    swap.events = []
    for layer in layers[1:]:
        layer.seen.clear()
    checkpointed = [] if checkpointing == "none" else range(len(layers))
    outs, grads = _train(layers, checkpointed, checkpointing == "offload", swap)
    for got, want in zip(outs + grads, plain_outs + plain_grads):
        assert torch.equal(got, want)
    # Parked (poisoned) between uses; each call ran on a fresh copy, never on the parked tensor.
    assert all(t.isnan().all() for i in swap.order for t in swap.tensors[i])
    assert not swap.loaded
    assert not {p for layer in (layers[1], layers[2], layers[4]) for p in layer.seen} & host_ptrs

    # p: prefetch, l: load, r: release. Forward: each layer's copy starts while the layer
    # before it runs (3 is resident: its turn prefetches 4). Backward, per micro-batch: the
    # last layer first, then each hook releases the layers behind it and prefetches the one
    # before; the embedding's output is a leaf, so its prefetch is released unused at the end
    # of the pass. The recompute (all, offload) runs inside each layer's backward, on the
    # weights loaded there: the same sequence.
    forward = "p0 l0 p1 r0 l1 p2 r1 l2 r2 p4 l4 r4"
    backward = "p4 l4 r4 p2 l2 p1 r2 l1 p0 r1 r0"
    got = " ".join(f"{action[0]}{i}" for action, i in swap.events)
    assert got == " ".join([forward, forward, backward, backward])
    calls = 4 * 2 * (1 if checkpointing == "none" else 2)  # recomputes run the layers again
    assert sum(len(layer.seen) for layer in layers[1:]) == calls
    # At most two swapped layers on the "device" at once, forward or backward.
    live, most = set(), 0
    for action, i in swap.events:
        if action == "prefetch":
            live.add(i)
        elif action == "release":
            live.discard(i)
        most = max(most, len(live))
    assert most <= 2


def test_a_layer_used_while_parked_fails():
    """What makes the test above mean something: a parked weight poisons what uses it."""
    layers = _layers()
    swap = BlockSwap(layers, {1}, poisoned=True)
    swap.attach(torch.device("cpu"))
    assert layers[1](_micro_batches(1)[0])[0].isnan().all()


def test_only_frozen_tensors_of_their_own_layer_swap():
    layers = _layers()
    layers[2].shared = layers[1].base  # a module two layers hold stays resident
    own = swappable(layers)
    assert set(own) == {0, 1, 2, 3, 4}
    ids = {i: {id(t) for t in ts} for i, ts in own.items()}
    assert id(layers[1].base.weight) not in ids[1] | ids[2] and id(layers[1].scale) in ids[1]
    assert all(not t.requires_grad for ts in own.values() for t in ts)
    assert first_swappable(layers, 2) == [0, 1]
    swap = BlockSwap(layers, {1, 2})
    swap.attach(torch.device("cpu"))
    assert layers[1].down.device.type == "cpu" and layers[1].down.numel() == 2 * WIDTH
    assert layers[1].base.weight.numel() == WIDTH * WIDTH  # shared: not touched
    # Parked on the host copy by default: a state dict reads the real values.
    assert torch.equal(layers[2].state_dict()["scale"], swap.host[2][-1])


def test_the_plan_can_unswap_a_layer():
    layers = _layers()
    swap = BlockSwap(layers, {1, 2, 3}, poisoned=True)
    swap.attach(torch.device("cpu"))
    swap.unswap({2})
    assert swap.order == [1, 3] and not layers[2].base.weight.isnan().any()
    plain_outs, plain_grads = _train(_layers())
    outs, grads = _train(layers, swap=swap)
    for got, want in zip(outs + grads, plain_outs + plain_grads):
        assert torch.equal(got, want)


def test_offload_keeps_no_activation_in_the_graph_and_restores_autocast_and_rng():
    torch.manual_seed(0)

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            h, ids = x
            return torch.dropout(self.lin(h), 0.5, True), ids

    layer, (h, ids) = Noisy(), _micro_batches(1)[0]
    h.requires_grad_()
    torch.manual_seed(5)
    plain = layer((h, ids))[0]
    plain.sum().backward()
    want = [h.grad.clone(), layer.lin.weight.grad.clone()]
    h.grad = layer.lin.weight.grad = None

    saved = []
    torch.manual_seed(5)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, out_ids = offloaded(layer, (h, ids))
    assert not saved  # nothing the size of an activation stays in autograd's graph
    assert out_ids is ids or torch.equal(out_ids, ids)
    assert torch.equal(out, plain)
    out.sum().backward()  # the recompute draws the forward's dropout mask again
    assert torch.equal(h.grad, want[0]) and torch.equal(layer.lin.weight.grad, want[1])

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = offloaded(layer, (h, ids))[0]
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()  # recomputed under bf16 autocast too: no dtype mismatch


@pytest.mark.slow  # compiles on the CPU
def test_a_compiled_swapped_layer_does_not_recompile():
    import torch._dynamo

    layers = _layers()
    for layer in layers:
        layer.compile()
    swap = BlockSwap(layers, {1, 2, 4})
    swap.attach(torch.device("cpu"))
    torch._dynamo.reset()
    _train(layers, range(len(layers)), False, swap)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for layer in layers:
        layer.zero_grad()
    outs, grads = _train(layers, range(len(layers)), False, swap)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    plain_outs, plain_grads = _train(_layers())
    for got, want in zip(outs + grads, plain_outs + plain_grads):
        torch.testing.assert_close(got, want)


def test_offload_returns_what_the_layer_returns():
    head = nn.Linear(WIDTH, 1)
    h, _ = _micro_batches(1)[0]
    single = offloaded(head, h.requires_grad_())
    assert torch.is_tensor(single) and single.shape == (3, 1)
    single.sum().backward()
    assert head.weight.grad is not None


def _run(**pipeline):
    from types import SimpleNamespace

    defaults = dict(stages=2, blocks_to_swap="0", memory_budget_gb=None)
    return SimpleNamespace(pipeline=SimpleNamespace(**{**defaults, **pipeline}))


def test_more_layers_to_swap_than_a_stage_has_is_refused_naming_the_count():
    from dpipe.errors import ConfigError
    from dpipe.pipeline.engine import _block_swap

    layers = _layers()  # stage 0: layers 0-1, stage 1: layers 2-4
    module = type("M", (), {"forward_funcs": layers[:2], "stage_id": 0})()
    with pytest.raises(ConfigError, match=r"blocks_to_swap=3.*stage 0 \(layers 0-1\) has 2 .*"
                                          r"at most 2"):
        _block_swap(layers, [0, 2, 5], module, _run(blocks_to_swap="3"))
    swap, auto = _block_swap(layers, [0, 2, 5], module, _run(blocks_to_swap="2"))
    assert swap.order == [0, 1] and not auto


def test_a_budget_below_the_weights_with_everything_swapped_names_the_minimum():
    from dpipe.errors import ConfigError
    from dpipe.pipeline.engine import _block_swap

    layers = _layers()
    module = type("M", (), {"forward_funcs": layers[2:], "stage_id": 1})()
    # stage 1 keeps its LoRA weights and gradients and two swapped layers' frozen weights
    lora = sum(2 * 4 * p.numel() for layer in layers[2:] for p in (layer.down, layer.up))
    frozen = 4 * (WIDTH * WIDTH + 2 * WIDTH)
    need = (lora + 2 * frozen) / (1 << 30)
    with pytest.raises(ConfigError, match=f"stage 1 needs even with every layer swapped: "
                                          f"{need:.2f} GiB"):
        _block_swap(layers, [0, 2, 5], module, _run(blocks_to_swap="1",
                                                      memory_budget_gb=need * 0.9))
    _block_swap(layers, [0, 2, 5], module, _run(blocks_to_swap="1", memory_budget_gb=need * 1.1))


@pytest.mark.parametrize("overrides,message", [
    (["pipeline.blocks_to_swap=many"], "blocks_to_swap='many': use a number"),
    (["pipeline.blocks_to_swap=auto"], "needs pipeline.activation_checkpointing=auto"),
    (["pipeline.blocks_to_swap=2", "model.mode=full"], "nothing frozen to swap"),
    (["pipeline.activation_checkpointing=unload"], "none, all, auto, offload"),
])
def test_bad_swap_settings_are_refused_at_compose_time(overrides, message):
    from dpipe.config.checks import validate
    from dpipe.errors import ConfigError
    from tests.unit.test_config import _compose

    with pytest.raises(ConfigError, match=message):
        validate(_compose(["model=tiny_flux", *overrides]))
    run = validate(_compose(["model=tiny_flux", "pipeline.blocks_to_swap=auto",
                             "pipeline.activation_checkpointing=auto"]))
    assert run.pipeline.blocks_to_swap == "auto"


def _quantized_layers():
    from dpipe.train.fp8 import QuantizedLinear

    layers = _layers()
    for layer in layers[1:]:
        layer.base = QuantizedLinear(layer.base)  # its per-row scale is a buffer
    return layers


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_swapped_buffers_survive_the_engine_moving_the_module(compiled):
    """`deepspeed.initialize` moves the module after the swap is built. On a GPU that move keeps
    each parameter (it sets `.data`) but registers a new tensor for each buffer, so the fp8
    base's scale of a swapped block was the empty placeholder when the layer ran (the 16 GiB
    FLUX preset failed at its first step). The move is made here as it is made there, with a
    copy of every tensor, since `.to("cpu")` of a CPU tensor returns the tensor itself."""
    plain_outs, plain_grads = _train(_quantized_layers())
    layers = _quantized_layers()
    swap = BlockSwap(layers, {1, 2, 4})
    for layer in layers:
        layer._apply(lambda t: t.to("cpu", copy=True))  # what module.to("cuda") does
        if compiled:
            layer.compile()
    swap.attach(torch.device("cpu"))
    assert all(layers[i].base.scale.numel() == WIDTH for i in (1, 2, 4))
    outs, grads = _train(layers, (), False, swap)
    for got, want in zip(outs + grads, plain_outs + plain_grads):
        torch.testing.assert_close(got, want)
