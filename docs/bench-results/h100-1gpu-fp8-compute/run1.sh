#!/bin/bash
# Device call 1 (2026-12-05): fp8 matmuls (model.base_compute=fp8). (1) scripts/bench_8bit_matmul.py --format fp8:
# the bf16 and fp8 matmul peaks, dpipe's fp8 Linear at FLUX.1-dev's shapes, its error;
# (2) dpipe-bench: the FLUX.1-dev LoRA (r32, 1024^2, 8 images per step, compiled, one GPU) with the
# defaults and with model.base_compute=fp8, in one call.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-560} ))
echo "=== bench_fp8_matmul ($(date -u +%T))" | tee -a $LOG
timeout 200 $PY ../../scripts/bench_8bit_matmul.py --format fp8 2>&1 | grep -v "Warning\|warn" \
  | tee $OUT/bench_fp8_matmul.md | tee -a $LOG
bench fp8 420 --warmup 2 --steps 3 \
  --run "lora: pipeline=single $L" \
  --run "lora-fp8-compute: pipeline=single $L model.base_compute=fp8"
