"""One HunyuanVideo 13B double-stream and one single-stream block (24 heads of 128, a 33-frame
512x512 clip: 9216 video + 256 text tokens, 96 real), compiled as training compiles them
(dpipe's HunyuanVideoBlock, `layer.compile()`), forward + backward, under three attention paths:

  sdpa            the default: a dense mask, run by SDPA's memory-efficient kernel
  flex-diffusers  model.attention=flex before this change: the dense mask, which diffusers turns
                  into a BlockMask by evaluating it at every (query, key) pair, in the block
  flex-dpipe      model.attention=flex now: the BlockMask built from the valid keys
                  (dpipe.models.attention_mask)
  flex-isolated   flex-dpipe, with FlexAttention compiled as a graph of its own (a graph break
                  around it): alone, at this shape, it compiled in 6 s and ran at 11.57 ms
                  (flex_compile.py); inside the compiled block, call 3 saw no first step in 80 s

Each case's process dumps its Python stacks every 45 s to OUT_DIR/CASE.stacks.txt, to show where
a slow compile spends its time; TORCH_LOGS=recompiles shows a case compiling again.

Usage: blocks.py CASE OUT_DIR (one case per process, so a slow compile can be cut off alone), then
blocks.py compare OUT_DIR. --smoke runs tiny blocks forward-only on the CPU.
"""

import faulthandler
import sys
import time
from pathlib import Path

import torch
from diffusers.models.transformers.transformer_hunyuan_video import (
    HunyuanVideoRotaryPosEmbed, HunyuanVideoSingleTransformerBlock, HunyuanVideoTransformerBlock)

from dpipe.config.schema import AttentionKernel
from dpipe.models.hunyuan_video.layers import HunyuanVideoBlock
from dpipe.models.sync_free import carrier

SMOKE = "--smoke" in sys.argv
args = [a for a in sys.argv[1:] if a != "--smoke"]
CASE, OUT = args[0], Path(args[1])
DEVICE = "cpu" if SMOKE else "cuda"
HEADS, HEAD_DIM, GRID, TEXT, REAL = (2, 16, (2, 4, 4), 16, 5) if SMOKE else (24, 128, (9, 32, 32),
                                                                            256, 96)
ROPE = [4, 6, 6] if SMOKE else [16, 56, 56]
WIDTH = HEADS * HEAD_DIM
torch.backends.cuda.enable_cudnn_sdp(False)  # as in training (dpipe/train/loop.py)


def inputs():
    torch.manual_seed(1)
    image = GRID[0] * GRID[1] * GRID[2]
    hidden = torch.randn(1, image, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    text = torch.randn(1, TEXT, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    temb = torch.randn(1, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    text_mask = (torch.arange(TEXT, device=DEVICE) < REAL).long()[None]
    return hidden, text, temb, text_mask, carrier(*GRID, device=DEVICE)


def layers(case):
    torch.manual_seed(0)
    rope = HunyuanVideoRotaryPosEmbed(2, 1, ROPE)
    kernel = AttentionKernel.flex if case in ("flex-dpipe", "flex-isolated") else AttentionKernel.sdpa
    if case == "flex-isolated":
        isolate_flex()
    out = []
    for name, cls in (("double", HunyuanVideoTransformerBlock),
                      ("single", HunyuanVideoSingleTransformerBlock)):
        with torch.device(DEVICE):
            block = cls(HEADS, HEAD_DIM, 4.0).to(torch.bfloat16)
        if case.startswith("flex"):
            block.set_attention_backend("flex") if hasattr(block, "set_attention_backend") else \
                [m.processor.__setattr__("_attention_backend", "flex")
                 for m in block.modules() if hasattr(getattr(m, "processor", None),
                                                     "_attention_backend")]
        layer = HunyuanVideoBlock(block, rope, name, 2, 1, kernel)
        if not SMOKE:  # inductor's CPU FlexAttention has no bf16 kernel
            layer.compile()
        out.append((name, layer))
    return out


def isolate_flex():
    """diffusers calls `flex_attention.flex_attention` from its module: replaced by a separately
    compiled FlexAttention that the block's compile does not trace into."""
    from torch.nn.attention import flex_attention as module

    compiled = torch.compile(module.flex_attention)
    module.flex_attention = torch.compiler.disable(lambda *a, **kw: compiled(*a, **kw))


def run_case(case):
    OUT.mkdir(parents=True, exist_ok=True)
    stacks = open(OUT / f"{case}.stacks.txt", "w")
    faulthandler.dump_traceback_later(45, repeat=True, file=stacks)
    results = {}
    for name, layer in layers(case):
        x = inputs()

        def step():
            if SMOKE:  # the CPU has no FlexAttention backward
                with torch.no_grad():
                    return layer(x)
            y = layer(x)
            (y[0].float().square().mean() + y[1].float().square().mean()).backward()
            return y

        sync = torch.cuda.synchronize if not SMOKE else (lambda: None)
        start = time.perf_counter()
        y = step()
        sync()
        first = time.perf_counter() - start
        print(f"{case:15s} {name}: first call (compile) {first:.1f} s", flush=True)
        step()
        sync()
        start = time.perf_counter()
        for _ in range(5):
            y = step()
        sync()
        ms = (time.perf_counter() - start) / 5 * 1e3
        print(f"{case:15s} {name}: {ms:.2f} ms per forward+backward", flush=True)
        grads = [p.grad.detach().float().clone() for p in layer.parameters()
                 if p.grad is not None][:4]
        results[name] = {"out": y[0].detach().float().cpu(), "grads": [g.cpu() for g in grads],
                         "first_s": first, "ms": ms}
        layer.zero_grad(set_to_none=True)
    torch.save(results, OUT / f"{case}.pt")


def compare():
    runs = {p.stem: torch.load(p) for p in sorted(OUT.glob("*.pt"))}
    reference = runs.get("sdpa")
    for case, res in runs.items():
        for name, r in res.items():
            diff = ""
            if reference is not None and case != "sdpa":
                ref = reference[name]
                d_out = (r["out"] - ref["out"]).abs().max().item() / ref["out"].abs().max().item()
                d_grad = max(((g - h).abs().max() / h.abs().max()).item()
                             for g, h in zip(r["grads"], ref["grads"])) if r["grads"] else 0.0
                diff = f"  vs sdpa: output {d_out:.1e}, grads {d_grad:.1e} (max abs, relative)"
            print(f"{case:15s} {name}: compile {r['first_s']:6.1f} s  {r['ms']:8.2f} ms{diff}")


if __name__ == "__main__":
    compare() if CASE == "compare" else run_case(CASE)
