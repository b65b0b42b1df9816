#!/bin/bash
# Device call 2 (2026-12-01, third session; one H200): the first stage's backward as DeepSpeed
# ran it against one pass, and the 1-GPU LoRA row again with the new per-stage audit (host syncs,
# backward passes) at FLUX.1-dev size.
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
cd $REPO
echo "=== stage 0 backward ($(date -u +%T))" | tee -a $LOG
timeout 200 $PY docs/bench-results/h200-1gpu-stage/stage_backward.py 2>&1 | grep "stage0-backward\|Error\|error" | tee -a $LOG
cd docs/bench-results
bench lora1 330 --warmup 2 --steps 3 --loader --run "lora-1gpu-compiled-loader: pipeline=single $L"
