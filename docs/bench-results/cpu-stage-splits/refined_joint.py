"""Stage splits of Z-Image 6B and Lumina 2 at real size (built on the meta device, on the CPU):
the balanced split by parameter counts (the layer costs before the twelfth session) and by the
modelled forward FLOPs (dpipe.models.refined_joint, now), each judged by the modelled FLOPs of
its slowest stage over the mean, at the longest caption and at 128 caption tokens.
`python docs/bench-results/cpu-stage-splits/refined_joint.py`; output in `output.txt`."""
import os; os.environ["HF_HUB_OFFLINE"]="1"
import torch
from diffusers import ZImageTransformer2DModel, Lumina2Transformer2DModel
from dpipe.models.z_image.sizes import Z_IMAGE_6B
from dpipe.models.lumina2.sizes import LUMINA2_2B
from dpipe.models.z_image.layers import z_image_layers
from dpipe.models.lumina2.layers import lumina2_layers
import dpipe.models.z_image.spec as zs, dpipe.models.lumina2.spec as ls
from dpipe.models.refined_joint import layer_forward_flops
from dpipe.pipeline.partition import balanced_bounds
for name, cls, cfg, mk, mod, text in [("Z-Image 6B", ZImageTransformer2DModel, Z_IMAGE_6B, z_image_layers, zs, 512),
                                       ("Lumina 2", Lumina2Transformer2DModel, LUMINA2_2B, lumina2_layers, ls, 256)]:
    with torch.device("meta"):
        den = cls.from_config({k: v for k, v in cfg.items() if not k.startswith("_")})
    layers = mk(den)
    for text_tokens in (text, 128):
        true = layer_forward_flops(layers, 4096, text_tokens, mod.PER_SAMPLE_WEIGHTS, mod.TEXT_WEIGHTS)
        new = layer_forward_flops(layers, 4096, text, mod.PER_SAMPLE_WEIGHTS, mod.TEXT_WEIGHTS)
        old = [float(sum(p.numel() for p in l.parameters())) for l in layers]
        if name.startswith("Z"):
            old[0] -= sum(p.numel() for p in layers[0].t_embedder.parameters())
        for stages in (2, 4, 8):
            res = []
            for costs in (old, new):
                b = balanced_bounds(costs, stages)
                worst = max(sum(true[b[i]:b[i+1]]) for i in range(stages))
                res.append((b[1:-1], worst / (sum(true) / stages)))
            print(f"{name} text {text_tokens} {stages} stages: params {res[0][0]} max/mean {res[0][1]:.3f}; flops {res[1][0]} max/mean {res[1][1]:.3f}")
