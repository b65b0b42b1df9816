#!/bin/bash
# Device call 3 (2026-12-07, one GPU): the 24 GiB presets under a hard 24 GiB allocation cap
# (an emulated card), LoRA r32, compiled: wan14b_lora_24gb (33 frames at 480x832),
# qwen_image_lora_24gb (1024^2), flux_lora_24gb (FLUX.1-dev, 1024^2).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
R="train.precision=bf16 pipeline.compile=true model.lora.rank=32 model.lora.alpha=32"
SIZE=14b bench wan24 220 --warmup 1 --steps 1 --memory-cap-gb 24 \
  --run "wan14b_lora_24gb: experiment=wan14b_lora_24gb pipeline.micro_batches=2 $R"
SIZE=20b bench qwen24 200 --warmup 1 --steps 1 --memory-cap-gb 24 \
  --run "qwen_image_lora_24gb: experiment=qwen_image_lora_24gb pipeline.micro_batches=4 $R"
SIZE=dev bench flux24 150 --warmup 2 --steps 1 --memory-cap-gb 24 \
  --run "flux_lora_24gb: experiment=flux_lora_24gb $L"
