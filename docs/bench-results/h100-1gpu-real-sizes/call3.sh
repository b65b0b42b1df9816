#!/bin/bash
# Device call 3 (2026-12-06, one H100): the presets under hard allocation caps (emulated cards):
# flux_lora_16gb under 16 GiB, wan14b_lora_24gb (33 frames at 480x832) and qwen_image_lora_24gb
# (1024^2) under 24 GiB. LoRA r32, compiled.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
SIZE=dev bench flux16 200 --warmup 2 --steps 2 --memory-cap-gb 16 \
  --run "flux_lora_16gb: experiment=flux_lora_16gb $L"
SIZE=14b bench wan24 220 --warmup 1 --steps 1 --memory-cap-gb 24 \
  --run "wan14b_lora_24gb: experiment=wan14b_lora_24gb train.precision=bf16 pipeline.micro_batches=2 pipeline.compile=true model.lora.rank=32 model.lora.alpha=32"
SIZE=20b bench qwen24 200 --warmup 2 --steps 1 --memory-cap-gb 24 \
  --run "qwen_image_lora_24gb: experiment=qwen_image_lora_24gb train.precision=bf16 pipeline.micro_batches=4 pipeline.compile=true model.lora.rank=32 model.lora.alpha=32"
