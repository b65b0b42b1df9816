"""Does cuDNN's SDPA backward read memory it did not write? hunt.py found NaN gradients from
cuDNN in the tiny FLUX model's training (finite inputs, finite incoming gradient), which the same
call replayed in a fresh process computed finite. Here each call runs after the caching
allocator's free blocks (small and large pools) were filled with NaN (or zeros, the control),
at the tiny model's shape and at real ones, token counts on and off multiples of 64 and 128,
with and without a key-padding mask; flash and memory-efficient as controls.
`python poison.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CASES = {  # name: (batch, heads, tokens, head dim, masked)
    "tiny_flux (96 tokens)": (1, 2, 96, 16, False),
    "64 tokens": (1, 2, 64, 16, False),
    "100 tokens": (1, 2, 100, 16, False),
    "128 tokens": (1, 2, 128, 16, False),
    "256 tokens": (1, 2, 256, 16, False),
    "96 tokens, d128": (1, 2, 96, 128, False),
    "96 tokens, masked": (2, 2, 96, 16, True),
    "FLUX.1-dev (4608)": (1, 24, 4608, 128, False),
    "4600 tokens": (1, 24, 4600, 128, False),
    "4672 tokens (64 mod 128)": (1, 24, 4672, 128, False),
    "Qwen-Image (4224), masked": (1, 24, 4224, 128, True),
    "HunyuanVideo 1.5 (14169)": (1, 16, 14169, 128, False),
}
KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}


def poison(value: float) -> None:
    """Fills free blocks of both pools with `value`: the next allocations reuse them."""
    held = [torch.empty(n, dtype=torch.uint8, device="cuda")
            for n in [512] * 256 + [4096] * 256 + [65536] * 64 + [2**20] * 32 + [2**22] * 16
            + [2**26] * 8 + [2**30] * 2]
    for t in held:
        t.view(torch.float32).fill_(value)
    del held


def attention(q, k, v, mask):  # diffusers' layout: (B, S, H, D) in, transposed for SDPA
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask).transpose(1, 2)


def call(backend, b, h, s, d, masked, fill):
    poison(fill)
    gen = torch.Generator("cuda").manual_seed(s)
    q, k, v, grad = (torch.randn(b, s, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = None
    if masked:  # the last sample's last fifth of keys is padding
        mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
        mask[-1, ..., s - s // 5:] = False
    with sdpa_kernel([backend]):
        out = attention(q, k, v, mask)
        out.backward(grad)
    return [int((~torch.isfinite(t)).sum()) for t in (out, q.grad, k.grad, v.grad)]


def main() -> None:
    print(torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    for name, (b, h, s, d, masked) in CASES.items():
        for kernel, backend in KERNELS.items():
            if masked and kernel == "flash":
                continue  # flash takes no mask
            for fill in (float("nan"), 0.0):
                try:
                    counts = [call(backend, b, h, s, d, masked, fill) for _ in range(3)]
                except RuntimeError as e:
                    print(f"{name:27s} {kernel:9s} fill {fill}: failed {str(e)[:120]}", flush=True)
                    continue
                bad = ["out/dq/dk/dv non-finite " + "/".join(map(str, c)) for c in counts if any(c)]
                print(f"{name:27s} {kernel:9s} free memory {'NaN ' if fill != fill else 'zero'}: "
                      f"{f'{len(bad)}/3 calls: ' + bad[0] if bad else 'finite in 3/3 calls'}",
                      flush=True)


if __name__ == "__main__":
    main()
