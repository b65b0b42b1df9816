"""Where does FlexAttention's time go on this stack? In call 3 (../h200-1gpu-video) nothing with
model.attention=flex finished: the 13B bench in 300 s, the tiny GPU tests in 150 s, the
micro-benchmark's compiled case in 100 s. Here each step is timed separately at a small shape,
and Python's stacks are dumped every 40 s, so a hang shows where it is."""

import faulthandler
import sys
import time

import torch
import triton
from torch._inductor import config as inductor_config
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

faulthandler.dump_traceback_later(40, repeat=True, file=sys.stderr)
print(f"torch {torch.__version__} triton {triton.__version__} "
      f"compile_threads {inductor_config.compile_threads}", flush=True)
START = time.perf_counter()


def step(name, fn):
    print(f"-- {name} ... (t={time.perf_counter() - START:.0f}s)", flush=True)
    t = time.perf_counter()
    try:
        fn()
        torch.cuda.synchronize()
        print(f"-- {name}: {time.perf_counter() - t:.1f} s", flush=True)
    except Exception as e:
        print(f"-- {name} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)


def qkv(s, h=4, d=64):
    return [torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)]


compiled = torch.compile(flex_attention)
q, k, v = qkv(1024)
step("compiled flex, no mask, forward", lambda: compiled(q, k, v))
step("compiled flex, no mask, forward again", lambda: compiled(q, k, v))
step("compiled flex, no mask, forward+backward", lambda: compiled(q, k, v).sum().backward())
step("compiled flex, no mask, forward+backward again",
     lambda: compiled(q, k, v).sum().backward())
valid = torch.tensor([900], device="cuda")
mask = create_block_mask(lambda b, h, qi, ki: ki < valid[b], 1, None, 1024, 1024)
step("compiled flex, BlockMask, forward+backward",
     lambda: compiled(q, k, v, block_mask=mask).sum().backward())
q2, k2, v2 = qkv(1536)
mask2 = create_block_mask(lambda b, h, qi, ki: ki < valid[b], 1, None, 1536, 1536)
step("compiled flex, BlockMask, new length (recompile?), forward+backward",
     lambda: compiled(q2, k2, v2, block_mask=mask2).sum().backward())

from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

dense = (torch.arange(1024, device="cuda") < 900)[None, None, None, :]
qd, kd, vd = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
via_diffusers = torch.compile(lambda: dispatch_attention_fn(
    qd, kd, vd, attn_mask=dense, backend=AttentionBackendName.FLEX))
step("diffusers flex, dense mask, compiled, forward+backward",
     lambda: via_diffusers().sum().backward())
step("diffusers flex, dense mask, compiled, forward+backward again",
     lambda: via_diffusers().sum().backward())

# HunyuanVideo 13B's shape (../h200-1gpu-video/attention.py): 24 heads of 128, 9472 tokens.
S, REAL = 9472, 9216 + 96
qh, kh, vh = qkv(S, 24, 128)
validh = torch.tensor([REAL], device="cuda")
maskh = create_block_mask(lambda b, h, qi, ki: ki < validh[b], 1, None, S, S)
grad = torch.randn_like(qh)
run = lambda: compiled(qh, kh, vh, block_mask=maskh).backward(grad)
step("13B shape, BlockMask, first", run)
for _ in range(2):
    run()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(10):
    run()
torch.cuda.synchronize()
ms = (time.perf_counter() - t) / 10 * 1e3
flops = 4 * 24 * S * S * 128 * 3
print(f"13B shape, BlockMask: {ms:.2f} ms per forward+backward, {flops / ms / 1e9:.1f} TFLOP/s "
      f"(native masked was 30.08 ms, flash unmasked 12.22 ms)", flush=True)
faulthandler.cancel_dump_traceback_later()
