"""Compiled on the CPU, the tiny HiDream's layers with diffusers' MoE and with dpipe's sync-free
one (dpipe/models/hidream/moe.py), one forward + backward in training mode: how many graphs and
graph breaks, and the compile time. Run: python docs/bench-results/h200-1gpu-next/moe_graphs.py"""

import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo
from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from dpipe.config.schema import ModelConfig
from dpipe.models.hidream.moe import SyncFreeMoE
from dpipe.models.hidream.tiny import make_tiny_hidream
from dpipe.models.registry import build_spec
from dpipe.models.spec import NoisedBatch

d = make_tiny_hidream(Path(tempfile.mkdtemp()) / "hidream")
cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                          {"family": "hidream", "path": str(d),
                                           "max_text_tokens": 32}))
spec = build_spec(cfg)
enc = spec.load_encoders(torch.device("cpu"), torch.float32)
text = spec.encode_prompts(enc, ["a red circle on a blue background"])
x0 = torch.randn(1, 16, 16, 16)
noise, t = torch.randn_like(x0), torch.tensor([0.5])
noisy, target = spec.noise(x0, noise, t)
inputs, _ = spec.make_inputs(NoisedBatch(x0, noise, t, noisy, target, text))

for moe in ("diffusers", "sync-free"):
    torch._dynamo.reset()
    counters.clear()
    den = spec.load_denoiser(torch.float32).train()
    layers = spec.pipeline_layers(den)  # gives every MoE the sync-free forward
    if moe == "diffusers":
        for m in den.modules():
            if type(m) is SyncFreeMoE:
                m.__class__ = MOEFeedForwardSwiGLU
    for layer in layers:
        layer.compile()
    start = time.perf_counter()
    x = inputs
    for layer in layers:
        x = layer(x)
    x.float().square().mean().backward()
    breaks = sum(counters["graph_break"].values())
    print(f"{moe:10s} compile + first step {time.perf_counter() - start:6.1f} s, "
          f"unique graphs {counters['stats']['unique_graphs']}, graph breaks {breaks}",
          flush=True)
    if "-v" in sys.argv:
        for reason, n in counters["graph_break"].items():
            print(f"   {n} x {reason[:150]}")
