"""The first stage of a 2-stage FLUX.1-dev run at [23] (embedder, 19 double, 3 single blocks),
eager or compiled (--compile), one 1024x1024 micro-batch, on one GPU: its backward as DeepSpeed ran it (one
`out.backward(grad, retain_graph=True)` per float output: image stream, text stream, conditioning)
against one pass over all outputs (dpipe's StageEngine). Full fine-tune (bf16 weights) and LoRA r32.
Calls 2-4 failed: cuDNN's attention was left on (training turns it off: illegal memory
accesses on H200); in call 2 AOTAutograd's donated buffers also refused retain_graph=True.
python stage_backward.py [--compile] [--one-pass-only]  (from the repository root, with PYTHONPATH=.)"""

import statistics
import sys

import torch
import torch._functorch.config

from dpipe.bench.worker import fixed_micro_batches
from dpipe.config.compose import compose_run
from dpipe.models.registry import build_spec
from dpipe.train.trainable import trainable_layers

SPLIT = 23
COMPILE = "--compile" in sys.argv
ONE_PASS_ONLY = "--one-pass-only" in sys.argv


def measure(overrides):
    torch.backends.cuda.enable_cudnn_sdp(False)  # as in training: its kernels fail here (calls 2-4)
    run = compose_run(["model=flux", "model.path=/unused", "dataset=synthetic", "pipeline=single",
                       "train.precision=bf16", *overrides])
    spec = build_spec(run.model)
    denoiser = spec.random_denoiser("dev", torch.bfloat16, torch.device("cuda"))
    layers = trainable_layers(spec, run, denoiser)[:SPLIT]
    if COMPILE:
        if not ONE_PASS_ONLY:
            torch._functorch.config.donated_buffer = False  # it refuses retain_graph=True
        for layer in layers:
            layer.compile()
    (inputs, _), = fixed_micro_batches(spec, "dev", 1, 1, 0)
    x = tuple(t.cuda() for t in inputs)
    times = {"per output (DeepSpeed)": [], "one pass (dpipe)": []}
    if ONE_PASS_ONLY:
        del times["per output (DeepSpeed)"]
    for i in range(8):
        mode = list(times)[i % len(times)]
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as the engine runs these layers
            out = x
            for layer in layers:
                out = layer(out)
        tensors = [t for t in out if t.is_floating_point()]
        grads = [torch.randn_like(t) for t in tensors]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if mode.startswith("per output"):
            for k, (t, g) in enumerate(zip(tensors, grads)):
                t.backward(gradient=g, retain_graph=k < len(tensors) - 1)
        else:
            torch.autograd.backward(tensors, grads)
        end.record()
        torch.cuda.synchronize()
        for p in denoiser.parameters():
            p.grad = None
        if i >= 2:  # the first two compile the backward graphs
            times[mode].append(start.elapsed_time(end))
    del denoiser, layers
    torch.cuda.empty_cache()
    return {k: statistics.median(v) for k, v in times.items()}


for name, overrides in (("full", ["model.mode=full", "optim.master_weights=false"]),
                        ("lora r32", ["model.lora.rank=32", "model.lora.alpha=32"])):
    result = measure(overrides)
    print(f"[stage0-backward] {name}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in result.items())
          + (f" (ratio {result['per output (DeepSpeed)'] / result['one pass (dpipe)']:.2f})"
             if len(result) == 2 else "") + (" compiled" if COMPILE else " eager"), flush=True)
sys.exit(0)
