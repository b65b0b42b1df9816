"""Each pipeline layer's forward and backward time alone on one GPU, at a real size with random
weights: the measured figures behind a family's `layer_costs`, which balance pipeline stages.

    python -m dpipe.bench.layers --size dev pipeline.compile=true train.precision=bf16 \
        model.mode=full optim.master_weights=false

Each layer runs on the previous layer's output for one micro-batch; floating inputs after the
first layer require grad, as at a stage boundary, and backward is one pass from every floating
output with random gradients. Prints a line per layer, the mean per kind of layer (its class and
where its first submodule lives, numbers dropped) relative to the most common kind, the split
that balances the measured times for 2, 4 and 8 stages (to pass as `pipeline.split`) next to
the spec's own, and writes the figures as JSON (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from dpipe.bench.overrides import bench_overrides
from dpipe.config.compose import compose_run
from dpipe.config.schema import Precision
from dpipe.models.registry import build_spec
from dpipe.pipeline.engine import deepspeed_bf16
from dpipe.pipeline.partition import balanced_bounds
from dpipe.pipeline.attention import use_sdpa_kernels

DEFAULTS = ["model.path=/unused", "dataset=synthetic", "pipeline=single"]


def layer_kind(layer) -> str:
    first = next(iter(layer.source_names.values()), "")
    return f"{type(layer).__name__} {re.sub(r'[.]?[0-9]+', '', first)}".strip()


def _floats(outputs) -> list[torch.Tensor]:
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [t for t in outputs if t.is_floating_point() and t.requires_grad]


class Clock:
    """Marks in the GPU's stream (CUDA events), or the host's clock on CPU (a smoke test)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        if not self.cuda:
            return (end - start) * 1000
        torch.cuda.synchronize()
        return start.elapsed_time(end)


def time_layer(layer, inputs: tuple, cast, repeat: int, clock: Clock):
    """(forward ms, backward ms) medians over `repeat` runs after one warm-up, and the output."""
    forward, backward = [], []
    for i in range(repeat + 1):
        start = clock.mark()
        with cast:
            out = layer(inputs)
        forward_done = clock.mark()
        tensors = _floats(out)
        grads = [torch.randn_like(t) for t in tensors]
        backward_start = clock.mark()
        if tensors:
            torch.autograd.backward(tensors, grads)
        end = clock.mark()
        for p in layer.parameters():
            p.grad = None
        if i:
            forward.append(clock.ms(start, forward_done))
            backward.append(clock.ms(backward_start, end))
    detached = tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()
    return statistics.median(forward), statistics.median(backward), detached


def best_splits(times: list[float], spec_costs: list[float], most: int = 8) -> dict[int, dict]:
    """For 2, 4 and 8 stages (as many as there are layers): the split that balances the measured
    times, and the spec's own (`layer_costs`), each with its slowest stage's time."""
    def slowest(bounds):
        return max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:]))

    out = {}
    for stages in (2, 4, most):
        if stages > len(times) or stages in out:
            continue
        measured, own = balanced_bounds(times, stages), balanced_bounds(spec_costs, stages)
        out[stages] = {"measured": measured[1:-1], "measured_ms": slowest(measured),
                       "spec": own[1:-1], "spec_ms": slowest(own)}
    return out


def main() -> int:
    from dpipe.bench.worker import fixed_micro_batches, require_size
    from dpipe.train.trainable import trainable_layers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="dev")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="outputs/bench/layers.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and args.size != "tiny":
        raise SystemExit("error: dpipe.bench.layers times layers on a GPU and none is visible "
                         "(--size tiny runs a CPU smoke test)")
    run = compose_run(bench_overrides(args.overrides, DEFAULTS))
    use_sdpa_kernels(run.model, run.pipeline.compiles)  # as in training (dpipe/train/loop.py)
    spec = build_spec(run.model)
    require_size(spec, args.size)
    spec = spec.for_benchmark(args.size)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    bf16 = run.train.precision == Precision.bf16
    denoiser = spec.random_denoiser(args.size, torch.bfloat16 if bf16 else torch.float32, device)
    layers = trainable_layers(spec, run, denoiser)
    (inputs, _labels), = fixed_micro_batches(spec, args.size, 1, run.pipeline.micro_batch_size,
                                             run.train.seed)
    x = tuple(t.to(device) for t in inputs)
    autocast = bf16 and not deepspeed_bf16(run)  # as the pipeline engine runs its layers
    rows = []
    for index, layer in enumerate(layers):
        if run.pipeline.compiles:
            layer.compile()
        if index:
            x = tuple(t.requires_grad_() if t.is_floating_point() else t for t in x)
        cast = (torch.autocast(device.type, dtype=torch.bfloat16) if autocast
                else contextlib.nullcontext())
        fwd, bwd, x = time_layer(layer, x, cast, args.repeat, Clock(cuda))
        rows.append({"layer": index, "kind": layer_kind(layer), "forward_ms": fwd,
                     "backward_ms": bwd})
        print(f"{index:3d} {rows[-1]['kind']:48s} forward {fwd:8.2f} ms  backward {bwd:8.2f} ms",
              flush=True)
    by_kind = defaultdict(list)
    for r in rows:
        by_kind[r["kind"]].append(r["forward_ms"] + r["backward_ms"])
    common = Counter(r["kind"] for r in rows).most_common(1)[0][0]
    unit = statistics.mean(by_kind[common])
    summary = {kind: {"layers": len(t), "mean_ms": statistics.mean(t),
                      "relative": statistics.mean(t) / unit} for kind, t in by_kind.items()}
    for kind, s in summary.items():
        print(f"{kind:52s} x{s['layers']:<3d} {s['mean_ms']:8.2f} ms  "
              f"{s['relative']:.3f} of {common}")
    times = [r["forward_ms"] + r["backward_ms"] for r in rows]
    splits = best_splits(times, spec.layer_costs(layers))
    for stages, s in splits.items():
        print(f"{stages} stages: pipeline.partition=explicit pipeline.split={s['measured']} "
              f"(slowest stage {s['measured_ms']:.1f} ms per micro-batch; the spec's own split "
              f"{s['spec']}: {s['spec_ms']:.1f} ms)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"overrides": args.overrides, "size": args.size, "layers": rows,
                               "kinds": summary, "splits": splits}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
