"""fp8 against bf16 matmuls on this GPU: the peak rates, and dpipe's fp8 Linear
(`model.base_compute=fp8`, dpipe.train.fp8_compute) at FLUX.1-dev's Linear shapes, forward and the
input gradient, eager and compiled, with its error against an fp32 reference.

    python scripts/bench_fp8_matmul.py [--tokens 4608] [--iters 20]

Prints one table per part; needs a CUDA GPU with fp8 matmuls (compute capability 8.9+).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from dpipe.train.fp8 import QuantizedLinear
from dpipe.train.fp8_compute import E4M3, E5M2, fp8_linear, quantize_rows

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


def peaks(iters: int) -> None:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * n ** 3
    rows = [("bf16", timed(lambda: a @ b, iters))]
    a8, b8 = a.to(E4M3), b.to(E4M3)
    one = torch.ones((), device="cuda")
    ra, rb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    bt = b8.t().contiguous().t()
    for name, sa, sb, fast in [("fp8 e4m3 tensor-wise", one, one, False),
                               ("fp8 e4m3 tensor-wise, fast accum", one, one, True),
                               ("fp8 e4m3 row-wise", ra, rb, False),
                               ("fp8 e4m3 row-wise, fast accum", ra, rb, True)]:
        rows.append((name, timed(lambda: torch._scaled_mm(
            a8, bt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast),
            iters)))
    print(f"\n## matmul peak, {n}^3\n\n| kind | ms | TFLOP/s |\n|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s * 1e3:.3f} | {flops / s / 1e12:.0f} |")


def linear_shapes(tokens: int, iters: int) -> None:
    print(f"\n## FLUX.1-dev Linears, {tokens} token rows: forward, input gradient (ms)\n")
    print("| Linear (in, out) | bf16 fwd | fp8 fwd | fp8 fwd compiled | bf16 grad | "
          "fp8 e4m3 grad | fp8 e5m2 grad | compiled fwd+grad bf16 | compiled fwd+grad fp8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, k, n in FLUX_SHAPES:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        lin = torch.nn.Linear(k, n, bias=False, device="cuda").requires_grad_(False)
        w16 = lin.weight.to(torch.bfloat16)
        q = QuantizedLinear(lin)
        w8, s = q.weight, q.scale
        g = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        ones = torch.ones(1, k, device="cuda")
        wt = w8.t().contiguous().t()
        fwd16 = timed(lambda: F.linear(x, w16), iters)
        fwd8 = timed(lambda: fp8_linear(x, w8, s, torch.bfloat16), iters)
        cf = torch.compile(lambda x: fp8_linear(x, w8, s, torch.bfloat16))
        fwd8c = timed(lambda: cf(x), iters)
        grad16 = timed(lambda: g @ w16, iters)

        def grad8(fmt):
            gq, gs = quantize_rows(g.float() * s, fmt)
            return torch._scaled_mm(gq, wt, scale_a=gs, scale_b=ones, out_dtype=torch.bfloat16)
        g43, g52 = timed(lambda: grad8(E4M3), iters), timed(lambda: grad8(E5M2), iters)
        xr = x.detach().requires_grad_()

        def step16(x):
            F.linear(x, w16).backward(g)

        def step8(x):
            fp8_linear(x, w8, s, torch.bfloat16).backward(g)
        s16 = torch.compile(step16)
        s8 = torch.compile(step8)
        c16, c8 = timed(lambda: s16(xr), iters), timed(lambda: s8(xr), iters)
        print(f"| {name} ({k}, {n}) | {fwd16 * 1e3:.3f} | {fwd8 * 1e3:.3f} | {fwd8c * 1e3:.3f} | "
              f"{grad16 * 1e3:.3f} | {g43 * 1e3:.3f} | {g52 * 1e3:.3f} | {c16 * 1e3:.3f} | "
              f"{c8 * 1e3:.3f} |")


def accuracy(tokens: int) -> None:
    """Errors against fp32 on the same (dequantised fp8) weight: what fp8 activations and
    gradients add on top of fp8 storage; and fp8 storage itself against the bf16 weight."""
    print(f"\n## error against fp32, {tokens} token rows (relative Frobenius; cosine)\n")
    print("| Linear | bf16 out | fp8 out | fp8 storage only (out) | bf16 grad | e4m3 grad | "
          "e5m2 grad | cos e4m3 grad | cos e5m2 grad |")
    print("|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for name, k, n in FLUX_SHAPES:
        x = torch.randn(tokens, k, device="cuda")
        x[:, :8] *= 20  # a few outlier channels, as real activations have
        lin = torch.nn.Linear(k, n, bias=False, device="cuda").requires_grad_(False)
        q = QuantizedLinear(lin)
        wd = q.dequantized()
        ref = x @ wd.t()
        g = torch.randn(tokens, n, device="cuda")
        gref = g @ wd

        def rel(a, b):
            return ((a.float() - b).norm() / b.norm()).item()

        def cos(a, b):
            return F.cosine_similarity(a.float().flatten(), b.flatten(), dim=0).item()
        out16 = F.linear(x.bfloat16(), wd.bfloat16())
        out8 = fp8_linear(x.bfloat16(), q.weight, q.scale, torch.bfloat16)
        store = rel(x @ lin.weight.t(), ref)  # fp32 weight vs its fp8 rounding
        grads = {}
        for fmt in (None, E4M3, E5M2):
            xr = x.bfloat16().requires_grad_()
            fp8_linear(xr, q.weight, q.scale, torch.bfloat16, fmt).backward(g.bfloat16())
            grads[fmt] = xr.grad
        print(f"| {name} | {rel(out16, ref):.2e} | {rel(out8, ref):.2e} | {store:.2e} | "
              f"{rel(grads[None], gref):.2e} | {rel(grads[E4M3], gref):.2e} | "
              f"{rel(grads[E5M2], gref):.2e} | {cos(grads[E4M3], gref):.6f} | "
              f"{cos(grads[E5M2], gref):.6f} |")


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
