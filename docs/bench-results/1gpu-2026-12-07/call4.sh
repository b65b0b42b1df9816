#!/bin/bash
# Device call 4 (2026-12-07, one GPU): the newest families at their released sizes, LoRA r32,
# 8 micro-batches, compiled, one GPU, auto checkpointing at 74 GiB: MiniMax H3 33B, ERNIE-Image
# 8B, Anima 2B, Cosmos 1.0 7B, OmniGen2 4B; and FLUX.1-dev's 24 GiB preset without its cap.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
A="pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=74"
SIZE=8b bench ernie 100 --warmup 1 --steps 1 --run "lora: model=ernie_image pipeline=single $L $A"
SIZE=2b bench anima 80 --warmup 1 --steps 1 --run "lora: model=anima pipeline=single $L $A"
SIZE=4b bench omnigen2 90 --warmup 1 --steps 1 --run "lora: model=omnigen2 pipeline=single $L $A"
SIZE=7b bench cosmos1 110 --warmup 1 --steps 1 --run "lora: model=cosmos1 pipeline=single $L $A"
SIZE=33b bench minimax 170 --warmup 1 --steps 1 --run "lora: model=minimax_h3 pipeline=single $L $A"
