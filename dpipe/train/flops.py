"""The FLOPs a training step executes, as torch counts them (FlopCounterMode), on the meta device:
the same trainable layers (LoRA or full) on the same micro-batches' shapes, forward and backward,
without a GPU and without values, in seconds at real size. Recomputation is not counted.

Training reports them as TFLOP/s per GPU (`perf/tflops_per_gpu`, rank 0's micro-batches standing
for every data-parallel rank's); `dpipe-bench` prints them beside the model-FLOP convention that
its MFU follows (`ModelSpec.train_flops`: 6 or 4 x parameters x tokens, plus attention). The
convention counts every weight for every token; where weights see fewer, it counts work that never
runs: FLUX.1-dev's modulation Linears see one token per image and each double-stream weight only
its own stream's tokens, so the convention counts 1.67x what a full fine-tune runs
(`tests/integration/test_bench.py`). The executed figure says how busy the GPU is.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dpipe.config.schema import AttentionKernel, BaseCompute, BaseDtype, Precision, RunConfig

log = logging.getLogger("dpipe")
META = torch.device("meta")
TensorShapes = tuple[tuple[torch.Size, torch.dtype], ...]
Shapes = tuple[TensorShapes, TensorShapes]  # a micro-batch's (inputs, labels)


def architecture(denoiser: nn.Module) -> Callable[[], nn.Module]:
    """What makes the denoiser's architecture on the meta device; it holds neither the model nor
    its weights. A diffusers model: its class and config. A denoiser of several diffusers models
    (Anima's transformer and text adapter): its class, given each part as its keyword argument
    of the same name."""
    cls = type(denoiser)
    if hasattr(cls, "from_config"):
        parts = {None: (cls, getattr(denoiser, "config", None))}
    else:
        parts = {name: (type(part), getattr(part, "config", None))
                 for name, part in denoiser.named_children()}
    parts = {name: (part_cls, None if config is None else dict(config))
             for name, (part_cls, config) in parts.items()}

    def make() -> nn.Module:
        if not parts or any(config is None or not hasattr(part_cls, "from_config")
                            for part_cls, config in parts.values()):
            raise TypeError(f"{cls.__name__} is not a diffusers model with a config, nor made "
                            "of such models")
        with META:
            made = {name: part_cls.from_config(config)
                    for name, (part_cls, config) in parts.items()}
            return made[None] if None in made else cls(**made)
    return make


def shapes_of(inputs: tuple, labels: tuple) -> Shapes:
    return (tuple((t.shape, t.dtype) for t in inputs), tuple((t.shape, t.dtype) for t in labels))


class StepFlops:
    """Executed FLOPs of micro-batches, each shape counted once. `meta_denoiser` makes the model
    on the meta device (`architecture`), when first needed. A model that cannot be counted (an op
    with no meta implementation) is reported once and counts None: a figure to show, never a
    reason to stop."""

    def __init__(self, spec, run: RunConfig, meta_denoiser: Callable[[], nn.Module]):
        self.spec, self._make = spec, meta_denoiser
        counted = copy.deepcopy(run)
        # Counted through PyTorch's SDPA and unquantized weights: the same matmuls, as ops the
        # counter knows (a fused kernel or the fp8 cast's custom op could hide them).
        counted.model.attention = AttentionKernel.sdpa
        counted.model.base_dtype = BaseDtype.auto
        counted.model.base_compute = BaseCompute.auto
        # Counted in fp32, inputs and weights alike: a FLOP does not depend on its dtype, and
        # bf16 training's mixed dtypes (bf16 frozen weights, fp32 adapters and latents) are made
        # consistent by autocast, which the meta device lacks: ops such as SDPA and conv refuse
        # them there (Z-Image's, Qwen-Image's and HunyuanVideo 1.5's counts failed so on an H200).
        counted.train.precision = Precision.fp32
        self.run = counted
        self._layers: list | None = None
        self._per_shape: dict[Shapes, int] = {}
        self.failed = False
        self._watched: list[Shapes] = []  # training: micro-batches not yet counted
        self._total: float = 0.0  # training: FLOPs counted since the last `take`

    # ---- training: watch each step's micro-batches, count after the step, take at each log ----
    def watch(self, micro_batches: Iterable[tuple[tuple, tuple]]) -> Iterator:
        """The micro-batches, unchanged, each one's shapes noted as it passes to the engine."""
        for inputs, labels in micro_batches:
            self._watched.append(shapes_of(inputs, labels))
            yield inputs, labels

    def new_shapes(self) -> bool:
        """Whether a watched micro-batch has a shape not counted yet (and counting works)."""
        return not self.failed and any(m not in self._per_shape for m in self._watched)

    def count_watched(self) -> None:
        """Adds the watched micro-batches' FLOPs (seconds for a new shape, then a lookup)."""
        counted = self.of(self._watched)
        self._watched.clear()
        if counted is not None:
            self._total += counted

    def take(self) -> float | None:
        """The FLOPs counted since the last take; None once counting has failed."""
        total, self._total = self._total, 0.0
        return None if self.failed else total

    def of(self, shapes: Iterable[Shapes]) -> float | None:
        """FLOPs of a step whose micro-batches have these shapes (`shapes_of` each)."""
        if self.failed:
            return None
        total = 0
        try:
            for micro in shapes:
                if micro not in self._per_shape:
                    self._per_shape[micro] = self._count(micro)
                total += self._per_shape[micro]
        except Exception as e:  # noqa: BLE001 (any failure of a figure: reported, not raised)
            self.failed = True
            log.warning("TFLOP/s not reported: counting %s's FLOPs on the meta device failed "
                        "(%s: %s)", self.spec.family, type(e).__name__, e)
            return None
        return float(total)

    def _count(self, micro: Shapes) -> int:
        from dpipe.train.trainable import trainable_layers

        if self._layers is None:
            # trainable_layers seeds the generators (LoRA init); training's own streams must
            # not notice this copy.
            with torch.random.fork_rng():
                self._layers = trainable_layers(self.spec, self.run, self._make())
        inputs, labels = ([torch.empty(s, dtype=torch.float32 if d.is_floating_point else d,
                                       device=META) for s, d in part] for part in micro)
        with FlopCounterMode(display=False) as counter:
            x = tuple(inputs)
            for layer in self._layers:
                x = layer(x)
            self.spec.loss(x, tuple(labels)).backward()
        return counter.get_total_flops()

