"""Compiled on the CPU, the tiny HunyuanVideo or Qwen-Image layers see one prompt of six lengths
after another (forward + backward): how many graphs does cutting the text padding cost? Run:
TORCH_LOGS=recompiles python docs/bench-results/h200-1gpu-flex/recompiles.py qwen_image"""

import sys
import tempfile
from pathlib import Path

import torch
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
for l in layers: l.compile()
caps = ["red", "two stars", "a cat on a mat", "a small blue circle on green",
        "an orange triangle on a grey background today",
        "one two three four five six seven eight nine ten"]
for c in caps:
    text = spec.encode_prompts(enc, [c])
    img = torch.rand(1, 3, 64, 64) * 2 - 1
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
