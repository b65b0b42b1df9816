#!/bin/bash
# Device call 2 (2026-12-06, one H100): LTX-2.3 at its released size (--size 22b: 121 frames at
# 512x768), LoRA r32, 8 micro-batches, compiled, auto checkpointing at a 74 GiB budget, video
# only and with sound (model.audio=true: 126 audio latents per clip); then the flux_lora_24gb
# preset under a hard 24 GiB allocation cap (an emulated 24 GB card).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
A="pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=74"
SIZE=22b bench ltx23 400 --warmup 2 --steps 2 --run "lora: model=ltx23 pipeline=single $L $A" \
  --run "lora-av: model=ltx23 model.audio=true pipeline=single $L $A"
SIZE=dev bench flux24 200 --warmup 2 --steps 2 --memory-cap-gb 24 \
  --run "flux_lora_24gb: experiment=flux_lora_24gb $L"
