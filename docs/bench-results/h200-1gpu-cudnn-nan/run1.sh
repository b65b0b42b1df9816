#!/bin/bash
# For one H200 (tenth session): where cuDNN's NaN comes from (hunt.py, ~4 min), then FLUX.1-dev
# LoRA r32 with cuDNN's attention at real size, every step's loss reported (dpipe-bench).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
echo "=== hunt ($(date -u +%T))" | tee -a $LOG
timeout 300 $PY h200-1gpu-cudnn-nan/hunt.py $OUT 2>&1 | grep -v "WARNING" | tee $OUT/hunt.txt | tail -40
bench flux-cudnn 330 --warmup 2 --steps 3 --loader \
  --run "flux-cudnn: model=flux pipeline=single $L model.attention=cudnn"
