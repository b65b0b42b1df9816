"""Benchmark of the optimizers' memory and step time (`optim=<name>`, dpipe.train.optim).

    .venv/bin/python scripts/bench_optimizers.py                       # CPU: 12 blocks of 512
    .venv/bin/python scripts/bench_optimizers.py --width 3072 --blocks 16 --dtype bf16   # GPU

A stack of transformer-like blocks (four width x width matrices, a 4x MLP pair, norm scales and
biases: the shapes of a DiT's trainable weights) in --dtype on CUDA if there is one, else on
the CPU. For each optimizer, built exactly as training builds it (its conf/optim/<name>.yaml):
three steps on random gradients, then
  state    the bytes of its state tensors (moments, factored moments, 8-bit blocks),
  /param   those bytes per trained parameter,
  peak     (CUDA) the most memory a step allocates beyond the weights and gradients (the
           state and the step's temporaries),
  step     the mean time of the steps after the first.
With --dtype bf16 the weights train in bf16, as `optim.master_weights=false` does (AdamW keeps
its moments in the weights' dtype); fp32 is what LoRA adapters and master weights use.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from dpipe.config.compose import compose_run
from dpipe.train.optim import build_optimizer

OPTIMIZERS = ["adamw", "adamw8bit", "adafactor", "came", "prodigy", "schedulefree_adamw", "muon"]


def blocks(width: int, count: int) -> nn.Module:
    def block() -> nn.Module:
        return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 3 * width),
                             nn.Linear(width, width), nn.LayerNorm(width),
                             nn.Linear(width, 4 * width), nn.Linear(4 * width, width))
    return nn.Sequential(*[block() for _ in range(count)])


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v))


def measure(name: str, model: nn.Module, steps: int) -> dict:
    cfg = compose_run([f"optim={name}", "optim.min_8bit_size=4096"]).optim
    params = [p for p in model.parameters()]
    optimizer = build_optimizer(list(model.named_parameters()), cfg)
    cuda = params[0].is_cuda
    times, peak = [], 0
    weights_and_grads = 2 * sum(p.numel() * p.element_size() for p in params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - weights_and_grads)
        times.append(time.perf_counter() - start)
    out = {"state": state_bytes(optimizer), "peak": peak if cuda else None,
           "step_s": sum(times[1:]) / max(1, len(times) - 1)}
    for p in params:
        p.grad = None
    del optimizer
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=OPTIMIZERS)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = blocks(args.width, args.blocks).to(device, dtype)
    n = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{n / 1e6:.1f} M parameters in {args.dtype} ({weights / 2**30:.2f} GiB) on {where}, "
          f"torch {torch.__version__}")
    print(f"{'optimizer':<20}{'state GiB':>10}{'/param B':>10}{'peak GiB':>10}{'step ms':>10}")
    for name in args.only:
        m = measure(name, model, args.steps)
        peak = "-" if m["peak"] is None else f"{m['peak'] / 2**30:.2f}"
        print(f"{name:<20}{m['state'] / 2**30:>10.3f}{m['state'] / n:>10.2f}{peak:>10}"
              f"{m['step_s'] * 1e3:>10.1f}")


if __name__ == "__main__":
    main()
