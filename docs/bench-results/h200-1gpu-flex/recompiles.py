"""Compiled on the CPU, the tiny HunyuanVideo or Qwen-Image layers see one prompt of six lengths
after another (forward + backward), images and 5-frame clips in turn: how many graphs do cut
text padding and frame buckets cost? (With dynamo's default limit of 8, HunyuanVideo's shared
block wrapper hit it; dpipe's engine raises it to 64, as here.) Run:
TORCH_LOGS=recompiles python docs/bench-results/h200-1gpu-flex/recompiles.py qwen_image"""

import sys
import tempfile
from pathlib import Path

import torch
import torch._dynamo
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from dpipe.config.schema import ModelConfig
from dpipe.models.registry import build_spec
from dpipe.models.spec import NoisedBatch
family = sys.argv[1]
if family == "qwen_image":
    from dpipe.models.qwen_image.tiny import make_tiny_qwen_image as make
else:
    from dpipe.models.hunyuan_video.tiny import make_tiny_hunyuan_video as make
d = make(Path(tempfile.mkdtemp()) / family)
extra = {"max_text_tokens": 24} if family == "qwen_image" else {"max_text_tokens": 32}
cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                          {"family": family, "path": str(d), **extra}))
spec = build_spec(cfg)
enc = spec.load_encoders(torch.device("cpu"), torch.float32)
den = spec.load_denoiser(torch.float32)
layers = spec.pipeline_layers(den)
torch._dynamo.config.recompile_limit = 64  # as dpipe/pipeline/engine.py sets it
for l in layers: l.compile()
caps = ["red", "two stars", "a cat on a mat", "a small blue circle on green",
        "an orange triangle on a grey background today",
        "one two three four five six seven eight nine ten"]
for c in caps:
    text = spec.encode_prompts(enc, [c])
    img = torch.rand(1, 3, *([5] if caps.index(c) % 2 else []), 64, 64) * 2 - 1
    x0 = spec.encode_images(enc, img)
    noise, t = torch.randn_like(x0), torch.tensor([0.5])
    noisy, target = spec.noise(x0, noise, t)
    inputs, _ = spec.make_inputs(NoisedBatch(x0, noise, t, noisy, target, text))
    x = inputs
    for l in layers:
        x = l(x)
    x.float().square().mean().backward()
    print(c, "text tokens", inputs[2].shape[1], "unique graphs so far",
          counters["stats"]["unique_graphs"], flush=True)
