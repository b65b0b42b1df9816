"""SDPA's kernels at the attention shapes of dpipe's benchmarks, bf16, forward and forward +
backward, one GPU: is there a faster kernel than the flash kernel training gets? (FLUX.1-dev's
LoRA step spends 40% of its GPU time in attention, 1.0 of 3.6 s in flash's backward.)
`python sdpa.py` prints one line per (shape, kernel): ms and TFLOP/s (4 x S^2 x D x H forward,
2.5x that for the backward; under the key-padding mask the same count, though a fifth of the
keys is skipped)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # (batch, heads, tokens, head dim)
    "FLUX.1-dev 1024^2 (4096 image + 512 text)": (1, 24, 4608, 128),
    "Qwen-Image 1024^2 (4096 + 128 text)": (1, 24, 4224, 128),
    "HunyuanVideo 1.5 33x480x832 (14040 + 129 text)": (1, 16, 14169, 128),
}
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION}


def timed(fn, repeat: int = 10) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    for name, (b, h, s, d) in SHAPES.items():
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        fwd_flops = 4 * b * h * s * s * d
        # The second pass: a key-padding mask (the last fifth of the keys), flash excluded.
        cases = [(kernel, backend, None) for kernel, backend in KERNELS.items()]
        padding = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
        padding[..., s - s // 5:] = False
        cases += [(f"{kernel}+mask", backend, padding) for kernel, backend in KERNELS.items()
                  if kernel != "flash"]
        for kernel, backend, mask in cases:
            try:
                with sdpa_kernel([backend]):
                    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

                    def step():
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(grad)
                    both = timed(step)
                bwd = both - fwd
                print(f"{name:46s} {kernel:14s} forward {fwd:7.2f} ms ({fwd_flops / fwd / 1e9:4.0f} "
                      f"TFLOP/s)  backward {bwd:7.2f} ms ({2.5 * fwd_flops / bwd / 1e9:4.0f} TFLOP/s)",
                      flush=True)
            except Exception as e:  # noqa: BLE001 (a kernel that cannot run is a finding)
                print(f"{name:46s} {kernel:14s} failed: {type(e).__name__}: {str(e)[:160]}",
                      flush=True)
            q.grad = k.grad = v.grad = None


if __name__ == "__main__":
    main()
