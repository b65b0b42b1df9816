"""Stage splits of SDXL's UNet at real size (built on the meta device, on the CPU): the balanced
split by parameter counts (the layer costs before the thirteenth session) and by the counted
forward FLOPs at 1024x1024 (dpipe.models.sdxl.costs, now), each judged by the FLOPs of its
slowest stage over the mean, at 1024^2 and at 768^2. The config is SDXL 1.0 base's
unet/config.json. `python docs/bench-results/cpu-stage-splits/sdxl.py`; output in `output.txt`."""
import os; os.environ["HF_HUB_OFFLINE"] = "1"
import time
import torch
from diffusers import UNet2DConditionModel
from dpipe.models.sdxl.costs import nominal_inputs
from dpipe.models.sdxl.layers import sdxl_layers
from dpipe.models.spec import counted_layer_flops
from dpipe.pipeline.partition import balanced_bounds

SDXL_BASE_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    block_out_channels=[320, 640, 1280], transformer_layers_per_block=[1, 2, 10],
    attention_head_dim=[5, 10, 20], cross_attention_dim=2048, use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816, norm_num_groups=32)

with torch.device("meta"):
    unet = UNet2DConditionModel.from_config(SDXL_BASE_UNET)
layers = sdxl_layers(unet)
params = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
start = time.perf_counter()
new = counted_layer_flops(layers, nominal_inputs(SDXL_BASE_UNET, 8, torch.device("meta")))
print(f"{len(layers)} layers, {sum(params) / 1e9:.2f}B parameters; counted in "
      f"{time.perf_counter() - start:.1f} s: {sum(new) / 1e12:.2f} TFLOP forward per 1024^2 image")
for pixels in (1024, 768):
    true = counted_layer_flops(layers, nominal_inputs(SDXL_BASE_UNET, 8, torch.device("meta"), pixels))
    for stages in (2, 4):
        shown = []
        for name, costs in (("params", params), ("flops", new)):
            b = balanced_bounds(costs, stages)
            worst = max(sum(true[b[i]:b[i + 1]]) for i in range(stages))
            shown.append(f"{name} {b[1:-1]} max/mean {worst / (sum(true) / stages):.3f}")
        print(f"SDXL {pixels}^2 {stages} stages: " + "; ".join(shown))
