"""Masked attention at HunyuanVideo 13B's shape (a 33-frame 512x512 clip: 9216 video tokens, then
256 text tokens of which 96 are real), forward + backward, through diffusers' attention
dispatcher as the blocks call it: which backend runs the text-padding mask fastest?"""

import time

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

torch.backends.cuda.enable_cudnn_sdp(False)  # as in training; the cudnn case enables it itself
B, H, D, IMAGE, TEXT, REAL = 1, 24, 128, 9216, 256, 96
S = IMAGE + TEXT
FLOPS = 4 * B * H * S * S * D * 3  # forward (QK and AV) + backward at twice the forward


def timed(backend, masked, compiled):
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    mask = (torch.arange(S, device="cuda") < IMAGE + REAL)[None, None, None, :] if masked else None
    if masked == "block":  # a BlockMask made once from the valid length, not from the dense mask
        from torch.nn.attention.flex_attention import create_block_mask

        valid = torch.full((B,), IMAGE + REAL, device="cuda")
        mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < valid[b], B, None, S, S)
    fn = lambda: dispatch_attention_fn(q, k, v, attn_mask=mask, backend=backend)
    if compiled:
        fn = torch.compile(fn)
    grad = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        fn().backward(grad)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        out = fn()
        out.backward(grad)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 10
    return seconds, out


reference = None
for backend, masked, compiled in [
        (AttentionBackendName.NATIVE, True, False), (AttentionBackendName.NATIVE, False, False),
        (AttentionBackendName.FLEX, True, True), (AttentionBackendName.FLEX, "block", True),
        (AttentionBackendName.FLEX, False, True), (AttentionBackendName._NATIVE_CUDNN, True, False)]:
    name = f"{backend.value:14s} mask={masked!s:5s} compiled={compiled!s:5s}"
    print(f"{name} ... ({time.strftime('%T')})", flush=True)
    try:
        if backend is AttentionBackendName._NATIVE_CUDNN:
            torch.backends.cuda.enable_cudnn_sdp(True)
        torch.manual_seed(0)
        seconds, out = timed(backend, masked, compiled)
        diff = ""
        if masked:
            if reference is None:
                reference = out.detach().float()
            diff = f"  max |out - native masked| {(out.detach().float() - reference).abs().max():.2e}"
        print(f"{name} {seconds * 1e3:7.2f} ms  {FLOPS / seconds / 1e12:6.1f} TFLOP/s{diff}",
              flush=True)
    except Exception as e:  # a backend that fails here is a finding, not a stop
        print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)
