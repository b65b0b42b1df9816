"""int8 against bf16 matmuls on this GPU: the peak rates, and dpipe's int8 Linear
(`model.base_compute=int8`, dpipe.train.int8_compute) at FLUX.1-dev's Linear shapes, forward and
the input gradient, eager and compiled, with its error against an fp32 reference.

    python scripts/bench_int8_matmul.py [--tokens 4608] [--iters 20]

Prints one table per part; needs a CUDA GPU with int8 matmuls (compute capability 8.0+). The
fp8 counterpart is scripts/bench_fp8_matmul.py (whose shapes and timer this uses).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench_fp8_matmul import FLUX_SHAPES, timed
from dpipe.train.fp8 import QuantizedLinear
from dpipe.train.fp8_compute import quantize_rows
from dpipe.train.int8_compute import INT8, int8_linear


def peaks(iters: int) -> None:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a8 = torch.randint(-127, 128, (n, n), device="cuda", dtype=torch.int8)
    b8t = torch.randint(-127, 128, (n, n), device="cuda", dtype=torch.int8).t()  # column-major
    rows = [("bf16", timed(lambda: a @ b, iters)),
            ("int8 (_int_mm, int32 out)", timed(lambda: torch._int_mm(a8, b8t), iters))]
    print(f"\n## matmul peak, {n}^3\n\n| kind | ms | T(FL)OP/s |\n|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s * 1e3:.3f} | {2 * n ** 3 / s / 1e12:.0f} |")


def linear_shapes(tokens: int, iters: int) -> None:
    print(f"\n## FLUX.1-dev Linears, {tokens} token rows: forward, input gradient (ms)\n")
    print("| Linear (in, out) | bf16 fwd | int8 fwd | int8 fwd compiled | bf16 grad | int8 grad | "
          "compiled fwd+grad bf16 | compiled fwd+grad int8 | compiled fwd+grad int8, bf16 grad |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, k, n in FLUX_SHAPES:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        lin = torch.nn.Linear(k, n, bias=False, device="cuda").requires_grad_(False)
        w16 = lin.weight.to(torch.bfloat16)
        q = QuantizedLinear(lin, INT8)
        w8, s = q.weight, q.scale
        g = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        wt = w8.t().contiguous().t()
        fwd16 = timed(lambda: F.linear(x, w16), iters)
        fwd8 = timed(lambda: int8_linear(x, w8, s, torch.bfloat16), iters)
        cf = torch.compile(lambda x: int8_linear(x, w8, s, torch.bfloat16))
        fwd8c = timed(lambda: cf(x), iters)
        grad16 = timed(lambda: g @ w16, iters)

        def grad8():
            gq, gs = quantize_rows(g.float() * s, INT8)
            return (torch._int_mm(gq, wt).float() * gs).to(torch.bfloat16)
        xr = x.detach().requires_grad_()

        def step16(x):
            F.linear(x, w16).backward(g)

        def step8(x, int8_grad):
            int8_linear(x, w8, s, torch.bfloat16, int8_grad).backward(g)
        s16, s8 = torch.compile(step16), torch.compile(step8)
        c16 = timed(lambda: s16(xr), iters)
        c8, c8b = timed(lambda: s8(xr, True), iters), timed(lambda: s8(xr, False), iters)
        print(f"| {name} ({k}, {n}) | {fwd16 * 1e3:.3f} | {fwd8 * 1e3:.3f} | {fwd8c * 1e3:.3f} | "
              f"{grad16 * 1e3:.3f} | {timed(grad8, iters) * 1e3:.3f} | {c16 * 1e3:.3f} | "
              f"{c8 * 1e3:.3f} | {c8b * 1e3:.3f} |")


def accuracy(tokens: int) -> None:
    """Errors against fp32 on the same (dequantised int8) weight: what int8 activations and
    gradients add on top of int8 storage; and int8 storage itself against the fp32 weight."""
    print(f"\n## error against fp32, {tokens} token rows (relative Frobenius; cosine)\n")
    print("| Linear | bf16 out | int8 out | int8 storage only (out) | bf16 grad | int8 grad | "
          "cos int8 grad |")
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for name, k, n in FLUX_SHAPES:
        x = torch.randn(tokens, k, device="cuda")
        x[:, :8] *= 20  # a few outlier channels, as real activations have
        lin = torch.nn.Linear(k, n, bias=False, device="cuda").requires_grad_(False)
        q = QuantizedLinear(lin, INT8)
        wd = q.dequantized()
        ref = x @ wd.t()
        g = torch.randn(tokens, n, device="cuda")
        gref = g @ wd

        def rel(a, b):
            return ((a.float() - b).norm() / b.norm()).item()
        out16 = F.linear(x.bfloat16(), wd.bfloat16())
        out8 = int8_linear(x.bfloat16(), q.weight, q.scale, torch.bfloat16)
        store = rel(x @ lin.weight.t(), ref)
        grads = {}
        for int8_grad in (False, True):
            xr = x.bfloat16().requires_grad_()
            int8_linear(xr, q.weight, q.scale, torch.bfloat16, int8_grad).backward(g.bfloat16())
            grads[int8_grad] = xr.grad
        cos = F.cosine_similarity(grads[True].float().flatten(), gref.flatten(), dim=0).item()
        print(f"| {name} | {rel(out16, ref):.2e} | {rel(out8, ref):.2e} | {store:.2e} | "
              f"{rel(grads[False], gref):.2e} | {rel(grads[True], gref):.2e} | {cos:.6f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4608)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    peaks(args.iters)
    linear_shapes(args.tokens, args.iters)
    accuracy(args.tokens)


if __name__ == "__main__":
    main()
