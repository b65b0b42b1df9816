"""The FLOPs a training step executes, as torch counts them (FlopCounterMode), on the meta device:
the same trainable layers (LoRA or full) on the same micro-batches' shapes, forward and backward,
without a GPU and in seconds at real size. Recomputation is not counted.

It stands beside the model-FLOP convention the benchmark's MFU follows (`ModelSpec.train_flops`:
6 or 4 x parameters x tokens, plus attention), which counts every weight for every token. Where
weights see fewer tokens, the convention counts work that never runs: FLUX.1-dev's modulation
Linears see one token per image and each double-stream weight only its own stream's tokens, so
the convention counts 1.67x what runs (`tests/integration/test_bench.py`). The executed figure
says how busy the GPU is; the convention's compares with other tools' figures.
"""

from __future__ import annotations

import copy

import torch
from torch.utils.flop_counter import FlopCounterMode

from dpipe.config.schema import AttentionKernel, BaseDtype


def executed_train_flops(spec, run, size: str, batches) -> float:
    """FLOPs of one step over `batches` ((inputs, labels) per micro-batch, on any device)."""
    from dpipe.train.trainable import trainable_layers

    meta = torch.device("meta")
    counted = copy.deepcopy(run)
    # Counted through PyTorch's SDPA and unquantized weights: the same matmuls, as ops the
    # counter knows (a fused kernel or the fp8 cast's custom op could hide them).
    counted.model.attention = AttentionKernel.sdpa
    counted.model.base_dtype = BaseDtype.auto
    layers = trainable_layers(spec, counted, spec.random_denoiser(size, torch.float32, meta))
    per_shape: dict[tuple, int] = {}  # micro-batches of one shape do the same work
    total = 0
    for inputs, labels in batches:
        shapes = tuple(tuple(t.shape) for t in (*inputs, *labels))
        if shapes not in per_shape:
            with FlopCounterMode(display=False) as counter:
                x = tuple(t.to(meta) for t in inputs)
                for layer in layers:
                    x = layer(x)
                spec.loss(x, tuple(t.to(meta) for t in labels)).backward()
            per_shape[shapes] = counter.get_total_flops()
        total += per_shape[shapes]
    return float(total)
