"""What each pipeline layer of a run's denoiser costs, from its real size on the meta device.

No weights are read and nothing is computed: the denoiser is built from its config on the meta
device and made trainable as training makes it (`dpipe.train.trainable`), and one micro-batch at
the run's largest bucket runs forward through the layers on meta tensors. That forward counts
each layer's FLOPs (torch's FlopCounterMode) and the bytes of the tensors autograd saves for
backward: the activations a kept (not recomputed) layer holds per micro-batch.

Attention on the meta device would take PyTorch's math kernel, which saves the full score matrix;
the GPU kernels dpipe trains with (flash, cuDNN, memory-efficient) save the output and one
log-sum-exp per query instead, so the forward here uses a stand-in that saves what they save.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, replace

import torch
from torch import nn

from dpipe.config.schema import BaseCompute, BaseDtype, Precision, RunConfig, TrainMode

# The saved bytes the meta forward counts (eager, uncompiled code), scaled to what a real step
# held: FLUX.1-dev LoRA r32, bf16 base, compiled, 1024^2, no recompute, one H200 peaked at 54.2
# GiB (docs/performance.md, target 4), 24.8 of them weights and LoRA state; the other 29.4 GiB are
# 0.385x the meta count of its 57 blocks' saved tensors and one block's more in flight (the fused
# compiled graphs save far less than eager code). One measurement of one model: other families,
# and eager runs, may hold more (the closing note lists the GPU rows still to measure).
ACTIVATION_CALIBRATION = 0.385


@dataclass(frozen=True)
class LayerFootprint:
    params: int  # all its parameters
    trainable: int  # of which trained (LoRA's, or all in a full fine-tune)
    trainable_bytes: int  # their bytes as stored on the device
    frozen_bytes: int  # its frozen weights and buffers in the run's base dtype (bf16 / fp32)
    quantizable: int  # elements of those weights that model.base_dtype=fp8 stores in 1 byte
    activations: int  # bytes it keeps for backward per micro-batch when not recomputed
    flops: float  # its forward's FLOPs per micro-batch
    cost: float  # the family's relative time (`layer_costs`), which balances the stages
    quantizable_rows: int = 0  # their rows: an 8-bit base keeps an fp32 scale for each
    largest_linear: int = 0  # elements of the largest of them: one is dequantized at a time


@dataclass(frozen=True)
class ModelFootprint:
    family: str
    layers: tuple[LayerFootprint, ...]
    tokens: int  # latent elements per micro-batch, per channel: how activations grew with size
    text_bytes: int  # one sample's cached text embeddings (bf16)
    latent_bytes: int  # one sample's cached latents at the largest bucket (bf16)
    # Whether a rank reads only its stage's weights (`ModelSpec.loads_stage_weights`).
    stage_loading: bool = False

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)


class _FlashLikeAttention(torch.autograd.Function):
    """Scaled dot-product attention on meta tensors that saves what the GPU kernels save."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the meta forward never runs backward
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@contextlib.contextmanager
def _flash_like_attention():
    original = torch.nn.functional.scaled_dot_product_attention

    def attention(query, key, value, *args, **kwargs):
        return _FlashLikeAttention.apply(query, key, value)

    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def run_latent_shape(bench_shape: tuple[int, ...], resolution: int, frames: int,
                     scale: tuple[int, int]) -> tuple[int, ...]:
    """A sample's latent shape at `resolution`^2 pixels and `frames` frames, from the shape the
    family's benchmark sample has: (C, H, W) for images, (C, F, H, W) for video; `scale` is the
    VAE's (spatial, temporal) downscale."""
    spatial, temporal = scale
    side = resolution // spatial
    if len(bench_shape) == 3:
        return (bench_shape[0], side, side)
    return (bench_shape[0], (frames - 1) // temporal + 1, side, side)


def _meta_inputs(spec, size: str, latent_shape: tuple[int, ...], audio: bool):
    """One micro-batch of the family's inputs, packed on the host (packing reads the text's
    padding, which meta tensors cannot tell) from zero latents at `latent_shape` and the family's
    random text, then moved to the meta device."""
    from dpipe.models.spec import NoisedBatch

    _, text = spec.random_sample(size)
    sound = {}
    if audio:
        a = spec.random_audio(size)[None]
        sound = {k: torch.zeros_like(a) for k in ("audio", "audio_noise", "audio_noisy",
                                                   "audio_target")}
    latents = torch.zeros((1, *latent_shape))
    text = {k: v[None] for k, v in text.items()}
    t = torch.full((1,), 0.5)
    noisy, target = spec.noise(latents, torch.zeros_like(latents), t)
    inputs, _ = spec.make_inputs(NoisedBatch(
        latents=latents, noise=torch.zeros_like(latents), timesteps=t, noisy=noisy,
        target=target, text=text, **sound))
    return tuple(x.to("meta") if torch.is_tensor(x) else x for x in inputs)


def _as_compute(x, dtype):
    """A stage boundary's tensors as the engine hands them on: floats in the compute dtype,
    requiring grad."""
    out = []
    for t in (x if isinstance(x, tuple) else (x,)):
        if torch.is_tensor(t) and t.is_floating_point():
            t = t.to(dtype).detach().requires_grad_()
        out.append(t)
    return tuple(out)


def block_linears(denoiser: nn.Module) -> set[int]:
    """The nn.Linear modules inside the denoiser's repeated blocks: those whose frozen weights
    model.base_dtype=fp8 stores in 8 bits (`dpipe.train.fp8.quantize_frozen_linears`' rule)."""
    out = set()
    for module in denoiser.modules():
        if isinstance(module, nn.ModuleList):
            out.update(id(m) for m in module.modules() if type(m) is nn.Linear)
    return out


def _same_kind(a: nn.Module, b: nn.Module) -> bool:
    """Whether two layers are blocks of one kind: the same class with the same parameter shapes."""
    shapes = lambda layer: [tuple(p.shape) for p in layer.parameters()]  # noqa: E731
    return type(a) is type(b) and shapes(a) == shapes(b)


def _one_block_each(config: dict) -> dict:
    """The denoiser's config with one block of each kind: every `num_..._layers` count at 1."""
    return {k: _one_block_each(v) if isinstance(v, dict) else
            (1 if isinstance(v, int) and k.startswith("num_") and "layers" in k and v > 1 else v)
            for k, v in config.items()}


def _kind(layer: nn.Module, adapted: bool) -> tuple[str, int]:
    """A layer's class and its own weights' count (an adapter's left out where `adapted`)."""
    return type(layer).__name__, sum(p.numel() for p in layer.parameters()
                                     if not (adapted and p.requires_grad))


def measure(spec, run: RunConfig, size: str, resolution: int, frames: int) -> ModelFootprint:
    """The footprint of `spec`'s denoiser at benchmark size `size` (its published config), trained
    as `run` says, for micro-batches of `run.pipeline.micro_batch_size` samples at
    `resolution`^2 and `frames` frames.

    Its blocks repeat: the real-size denoiser (without adapters, built in a second) gives the
    layers, their kinds and the family's stage-balancing costs, and a copy with one block of each
    kind, made trainable as training makes it, gives each kind's footprint (making dozens of
    real-size blocks trainable would take tens of seconds)."""
    spec = spec.for_benchmark(size)
    run = replace(run, model=replace(run.model, base_dtype=BaseDtype.auto,
                                     base_compute=BaseCompute.auto))  # the plan counts 8-bit storage
    real = spec.pipeline_layers(spec.random_denoiser(size, torch.float32, torch.device("meta")))
    costs = spec.layer_costs(real)
    bench_latents, text = spec.random_sample(size)
    shape = run_latent_shape(tuple(bench_latents.shape), resolution, frames, spec.latent_scale)
    lora = run.model.mode == TrainMode.lora
    small = copy.copy(spec)
    small.bench_configs = {**spec.bench_configs, size: _one_block_each(spec.bench_configs[size])}
    failures = (IndexError, RuntimeError, ValueError, KeyError)
    try:
        kinds = dict(zip(*_measured(small, run, size, shape, lora)))
    except failures:
        kinds = {}  # a family whose layer counts shape more than its blocks (HiDream, Krea 2)
    if not all(_kind(layer, False) in kinds for layer in real):  # or whose blocks differ
        try:
            kinds = dict(zip(*_measured(spec, run, size, shape, lora, skip_repeats=True)))
        except failures:  # blocks that each take their own inputs from the tuple (HiDream)
            kinds = dict(zip(*_measured(spec, run, size, shape, lora)))
    layers = tuple(replace(kinds[_kind(layer, False)], cost=cost)
                   for layer, cost in zip(real, costs))
    tokens = 1
    for d in shape[1:]:
        tokens *= d
    return ModelFootprint(
        family=spec.family, layers=layers, tokens=tokens,
        text_bytes=sum(v.numel() * 2 for v in text.values()),
        latent_bytes=2 * tokens * shape[0], stage_loading=spec.loads_stage_weights)


def layer_weights(layer: nn.Module, blocks: set[int] = frozenset()) -> dict[str, int]:
    """A trainable layer's weights as `LayerFootprint` counts them (what needs no forward): its
    parameters, the trained ones and their bytes, its frozen weights' and buffers' bytes, and
    the values of its frozen Linear weights among `blocks` (`block_linears` of its denoiser:
    what 8-bit storage quantizes), their rows and the largest one's values."""
    from dpipe.pipeline.block_swap import frozen_bytes

    trained = [p for p in layer.parameters() if p.requires_grad]
    quantizable = [m.weight for m in layer.modules()
                   if id(m) in blocks and not m.weight.requires_grad]
    return {"params": sum(p.numel() for p in layer.parameters()),
            "trainable": sum(p.numel() for p in trained),
            "trainable_bytes": sum(p.numel() * p.element_size() for p in trained),
            "frozen_bytes": frozen_bytes(layer),
            "quantizable": sum(w.numel() for w in quantizable),
            "quantizable_rows": sum(w.shape[0] for w in quantizable),
            "largest_linear": max((w.numel() for w in quantizable), default=0)}


def _measured(spec, run: RunConfig, size: str, shape: tuple[int, ...], lora: bool,
              skip_repeats: bool = False):
    """(each layer's kind, its footprint) of `spec`'s denoiser at `size`, made trainable;
    `skip_repeats`: a block like the one before it is taken as its copy, not run (the forwards
    of a real-size model's dozens of blocks would take seconds)."""
    from torch.utils.flop_counter import FlopCounterMode

    from dpipe.train.trainable import trainable_layers

    denoiser = spec.random_denoiser(size, torch.float32, torch.device("meta"))
    blocks = block_linears(denoiser)
    with torch.device("meta"):  # LoRA's weights too: nothing of the model takes host memory
        layers = trainable_layers(spec, run, denoiser)
    compute = torch.bfloat16 if run.train.precision == Precision.bf16 else torch.float32
    x = _meta_inputs(spec, size, shape, getattr(run.model, "audio", False))
    saved: list[torch.Tensor] = []

    def keep(t):
        saved.append(t)
        return t

    out: list[LayerFootprint] = []
    mbs = run.pipeline.micro_batch_size
    with _flash_like_attention(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        for i, layer in enumerate(layers):
            if skip_repeats and i and _same_kind(layer, layers[i - 1]):
                out.append(out[-1])  # a repeated block: the same shapes in and out
                continue
            saved.clear()
            x = _as_compute(x, compute)
            with FlopCounterMode(display=False) as flops:
                x = layer(x)
            params = {id(p) for p in layer.parameters()} | {id(b) for b in layer.buffers()}
            kept = {id(t): t.numel() * t.element_size() for t in saved if id(t) not in params}
            out.append(LayerFootprint(
                **layer_weights(layer, blocks if lora else set()),
                activations=int(mbs * ACTIVATION_CALIBRATION * sum(kept.values())),
                flops=float(mbs * flops.get_total_flops()), cost=0.0))
    return [_kind(layer, lora) for layer in layers], out
