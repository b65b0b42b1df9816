"""fp8 or int8 against bf16 matmuls on this GPU: the peak rates, and dpipe's 8-bit Linear
(`model.base_compute=fp8|int8`, dpipe.train.fp8_compute, dpipe.train.int8_compute) at FLUX.1-dev's
Linear shapes, forward and the input gradient, eager and compiled, with its error against an fp32
reference.

    python scripts/bench_8bit_matmul.py --format fp8|int8 [--tokens 4608] [--iters 20]

Prints one table per part; needs a CUDA GPU with the format's matmul (fp8: compute capability
8.9+, int8: 8.0+; dpipe.train.fp8.MATMUL_CAPABILITY).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from dpipe.train.fp8 import MATMUL_CAPABILITY, QuantizedLinear
from dpipe.train.fp8_compute import E4M3, E5M2, fp8_linear, quantize_rows
from dpipe.train.int8_compute import INT8, int8_linear

# FLUX.1-dev's Linears in the blocks, (in, out), with the token rows they see at 1024^2:
# the double blocks' image (4096) and text (512) streams, the single blocks' joint 4608.
FLUX_SHAPES = [("attn q/k/v/out", 3072, 3072), ("mlp up", 3072, 12288),
               ("mlp down", 12288, 3072), ("single proj_mlp", 3072, 12288),
               ("single proj_out", 15360, 3072)]


def timed(fn, iters: int) -> float:
    """Mean seconds per call, after warm-up (compiles included there)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def fp8_peaks(a: torch.Tensor, b: torch.Tensor, iters: int) -> list[tuple[str, float]]:
    n = a.shape[0]
    a8, b8 = a.to(E4M3), b.to(E4M3)
    one = torch.ones((), device="cuda")
    ra, rb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    bt = b8.t().contiguous().t()
    return [(name, timed(lambda: torch._scaled_mm(
        a8, bt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast), iters))
        for name, sa, sb, fast in [("fp8 e4m3 tensor-wise", one, one, False),
                                   ("fp8 e4m3 tensor-wise, fast accum", one, one, True),
                                   ("fp8 e4m3 row-wise", ra, rb, False),
                                   ("fp8 e4m3 row-wise, fast accum", ra, rb, True)]]


def int8_peaks(a: torch.Tensor, b: torch.Tensor, iters: int) -> list[tuple[str, float]]:
    n = a.shape[0]
    a8 = torch.randint(-127, 128, (n, n), device="cuda", dtype=torch.int8)
    b8t = torch.randint(-127, 128, (n, n), device="cuda", dtype=torch.int8).t()  # column-major
    return [("int8 (_int_mm, int32 out)", timed(lambda: torch._int_mm(a8, b8t), iters))]


def fp8_grad(g: torch.Tensor, wt: torch.Tensor, s: torch.Tensor, variant) -> torch.Tensor:
    """Backward's 8-bit product alone: (g * s) in `variant` per row, times W8 (column-major)."""
    gq, gs = quantize_rows(g.float() * s, variant)
    ones = torch.ones(1, wt.shape[1], device="cuda")
    return torch._scaled_mm(gq, wt, scale_a=gs, scale_b=ones, out_dtype=torch.bfloat16)


def int8_grad(g: torch.Tensor, wt: torch.Tensor, s: torch.Tensor, variant) -> torch.Tensor:
    gq, gs = quantize_rows(g.float() * s, INT8)
    return (torch._int_mm(gq, wt).float() * gs).to(torch.bfloat16)


@dataclass(frozen=True)
class Format:
    """What the tables compare for one format: its peak matmuls, its Linear's product
    (`matmul(x, w8, scale, out dtype, backward's variant)`), backward's variant in the compute
    dtype (`plain`), its 8-bit variants (`grads`: label -> variant; `compiled`: those timed
    compiled, forward and backward), and backward's 8-bit product alone (`grad`)."""

    storage: torch.dtype
    peaks: Callable
    unit: str  # of the peak rate: fp8 multiplies floats, int8 integers
    matmul: Callable
    plain: object
    grads: dict[str, object]
    compiled: dict[str, object]
    grad: Callable


FORMATS = {
    "fp8": Format(E4M3, fp8_peaks, "TFLOP/s", fp8_linear, None,
                  {"fp8 e4m3": E4M3, "fp8 e5m2": E5M2}, {"fp8": E4M3}, fp8_grad),
    "int8": Format(INT8, int8_peaks, "T(FL)OP/s", int8_linear, False, {"int8": True},
                   {"int8": True, "int8, bf16 grad": False}, int8_grad),
}


def peaks(fmt: Format, iters: int) -> None:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    rows = [("bf16", timed(lambda: a @ b, iters)), *fmt.peaks(a, b, iters)]
    print(f"\n## matmul peak, {n}^3\n\n| kind | ms | {fmt.unit} |\n|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s * 1e3:.3f} | {2 * n ** 3 / s / 1e12:.0f} |")


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def linear_shapes(compute: str, fmt: Format, tokens: int, iters: int) -> None:
    print(f"\n## FLUX.1-dev Linears, {tokens} token rows: forward, input gradient (ms)\n")
    header = ["Linear (in, out)", "bf16 fwd", f"{compute} fwd", f"{compute} fwd compiled",
              "bf16 grad", *(f"{label} grad" for label in fmt.grads), "compiled fwd+grad bf16",
              *(f"compiled fwd+grad {label}" for label in fmt.compiled)]
    print(_row(header))
    print(_row(["---"] * len(header)))
    for name, k, n in FLUX_SHAPES:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        lin = torch.nn.Linear(k, n, bias=False, device="cuda").requires_grad_(False)
        w16 = lin.weight.to(torch.bfloat16)
        q = QuantizedLinear(lin, fmt.storage)
        w8, s = q.weight, q.scale
        g = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        wt = w8.t().contiguous().t()
        times = [timed(lambda: F.linear(x, w16), iters),
                 timed(lambda: fmt.matmul(x, w8, s, torch.bfloat16), iters)]
        cf = torch.compile(lambda x: fmt.matmul(x, w8, s, torch.bfloat16))
        times += [timed(lambda: cf(x), iters), timed(lambda: g @ w16, iters)]
        times += [timed(lambda: fmt.grad(g, wt, s, v), iters) for v in fmt.grads.values()]
        xr = x.detach().requires_grad_()

        def step16(x):
            F.linear(x, w16).backward(g)

        def step8(x, variant):
            fmt.matmul(x, w8, s, torch.bfloat16, variant).backward(g)
        s16, s8 = torch.compile(step16), torch.compile(step8)
        times.append(timed(lambda: s16(xr), iters))
        times += [timed(lambda: s8(xr, v), iters) for v in fmt.compiled.values()]
        print(_row([f"{name} ({k}, {n})", *(f"{t * 1e3:.3f}" for t in times)]))


def accuracy(compute: str, fmt: Format, tokens: int) -> None:
    """Errors against fp32 on the same (dequantised 8-bit) weight: what 8-bit activations and
    gradients add on top of 8-bit storage; and 8-bit storage itself against the fp32 weight."""
    print(f"\n## error against fp32, {tokens} token rows (relative Frobenius; cosine)\n")
    header = ["Linear", "bf16 out", f"{compute} out", f"{compute} storage only (out)",
              "bf16 grad", *(f"{label} grad" for label in fmt.grads),
              *(f"cos {label} grad" for label in fmt.grads)]
    print(_row(header))
    print(_row(["---"] * len(header)))
    torch.manual_seed(0)
    for name, k, n in FLUX_SHAPES:
        x = torch.randn(tokens, k, device="cuda")
        x[:, :8] *= 20  # a few outlier channels, as real activations have
        lin = torch.nn.Linear(k, n, bias=False, device="cuda").requires_grad_(False)
        q = QuantizedLinear(lin, fmt.storage)
        wd = q.dequantized()
        ref = x @ wd.t()
        g = torch.randn(tokens, n, device="cuda")
        gref = g @ wd

        def rel(a, b):
            return ((a.float() - b).norm() / b.norm()).item()

        def cos(a, b):
            return F.cosine_similarity(a.float().flatten(), b.flatten(), dim=0).item()
        out16 = F.linear(x.bfloat16(), wd.bfloat16())
        out8 = fmt.matmul(x.bfloat16(), q.weight, q.scale, torch.bfloat16)
        store = rel(x @ lin.weight.t(), ref)  # the fp32 weight vs its 8-bit rounding
        grads = []
        for variant in (fmt.plain, *fmt.grads.values()):
            xr = x.bfloat16().requires_grad_()
            fmt.matmul(xr, q.weight, q.scale, torch.bfloat16, variant).backward(g.bfloat16())
            grads.append(xr.grad)
        print(_row([name, f"{rel(out16, ref):.2e}", f"{rel(out8, ref):.2e}", f"{store:.2e}",
                    *(f"{rel(gr, gref):.2e}" for gr in grads),
                    *(f"{cos(gr, gref):.6f}" for gr in grads[1:])]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=sorted(FORMATS), required=True)
    parser.add_argument("--tokens", type=int, default=4608)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    fmt = FORMATS[args.format]
    needed = MATMUL_CAPABILITY[args.format][0]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < needed:
        parser.exit(2, f"--format {args.format} needs a CUDA GPU of compute capability "
                       f"{needed[0]}.{needed[1]} or newer\n")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.format}")
    peaks(fmt, args.iters)
    linear_shapes(args.format, fmt, args.tokens, args.iters)
    accuracy(args.format, fmt, args.tokens)


if __name__ == "__main__":
    main()
