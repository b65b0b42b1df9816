"""Does cuDNN's SDPA kernel compute what flash does, at the shapes dpipe trains? (An earlier
session saw its backward fail or give NaN on an H200 with tiny models, and disabled it; sdpa.py
found it 2x as fast as flash at real sizes.) Per case: the output's and the three gradients'
largest error against an fp32 reference (math kernel on fp32 copies; flash for the largest
shape), relative to the reference's largest value, for cuDNN and for flash, five calls each
checked for NaN/inf; eager and compiled, in the layout diffusers passes (B, S, H, D transposed
to B, H, S, D: not contiguous), with and without a key-padding mask. `python cudnn_check.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CASES = {  # name: (batch, heads, tokens, head dim)
    "tiny_flux-like": (2, 2, 40, 16),
    "head dim 64": (2, 4, 300, 64),
    "FLUX.1-dev": (1, 24, 4608, 128),
    "Qwen-Image": (1, 24, 4224, 128),
    "HunyuanVideo 1.5": (1, 16, 14169, 128),
}
KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention(q, k, v, mask):  # diffusers' layout: (B, S, H, D) in, transposed for SDPA
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask)
    return out.transpose(1, 2)


COMPILED = torch.compile(attention, dynamic=False)


def run(fn, q, k, v, mask, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, mask)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def main() -> None:
    print(torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    gen = torch.Generator("cuda").manual_seed(0)
    for name, (b, h, s, d) in CASES.items():
        q, k, v, grad = (torch.randn(b, s, h, d, device="cuda", generator=gen,
                                     dtype=torch.bfloat16) for _ in range(4))
        for masked in (False, True):
            mask = None
            if masked:  # the second sample's last fifth of keys is padding
                mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
                mask[-1, ..., s - s // 5:] = False
            big = s > 10000
            if big and masked:
                continue
            if big:  # the fp32 math reference would need tens of GiB
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    ref = run(attention, q, k, v, mask, grad)
            else:
                with sdpa_kernel([SDPBackend.MATH]):
                    ref = run(attention, *(t.float() for t in (q, k, v)), mask, grad.float())
            for kernel, backend in KERNELS.items():
                if masked and kernel == "flash":
                    continue  # flash takes no mask
                for mode, fn in (("eager", attention), ("compiled", COMPILED)):
                    label = f"{name:17s} {str((b, h, s, d)):20s} mask={masked!s:5s} {kernel:9s} {mode:8s}"
                    try:
                        with sdpa_kernel([backend]):
                            results = [run(fn, q, k, v, mask, grad) for _ in range(5)]
                        bad = sum(not all(torch.isfinite(t).all() for t in r) for r in results)
                        errors = [((t.float() - r.float()).abs().max() / r.float().abs().max()).item()
                                  for t, r in zip(results[-1], ref)]
                        same = all(torch.equal(a, c) for r in results[1:]
                                   for a, c in zip(r, results[0]))
                        print(f"{label} rel. error out {errors[0]:.1e} dq {errors[1]:.1e} dk "
                              f"{errors[2]:.1e} dv {errors[3]:.1e}; non-finite in {bad}/5 calls; "
                              f"{'repeatable' if same else 'varies between calls'}", flush=True)
                    except Exception as e:  # noqa: BLE001 (a kernel that refuses is a finding)
                        print(f"{label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    torch._dynamo.reset()


if __name__ == "__main__":
    main()
