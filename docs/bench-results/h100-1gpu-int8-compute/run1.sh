#!/bin/bash
# Device call 1 for int8 matmuls (model.base_compute=int8), written 2026-12-07, not yet run:
# (1) the int8 GPU tests (tests/gpu/test_base_compute_gpu.py -k int8: 20-step losses within 1% of bf16,
# LoRA gradient cosines >= 0.99, no activation kept); (2) scripts/bench_8bit_matmul.py --format int8: the bf16
# and int8 matmul peaks, dpipe's int8 Linear at FLUX.1-dev's shapes, its error; (3) dpipe-bench:
# the FLUX.1-dev LoRA (r32, 1024^2, 8 images per step, compiled, one GPU) with the defaults, with
# model.base_compute=int8 and with model.base_compute=fp8, in one call (about 9 minutes on an H100).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-580} ))
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $LOG
echo "=== GPU tests ($(date -u +%T))" | tee -a $LOG
(cd ../.. && timeout 150 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_base_compute_gpu.py -k int8 \
  2>&1 | grep -E "assert|passed|failed|Error|skipped" | head -30) | tee -a $LOG
echo "=== bench_int8_matmul ($(date -u +%T))" | tee -a $LOG
(cd ../.. && PYTHONPATH=$PWD timeout 100 $PY scripts/bench_8bit_matmul.py --format int8 2>&1) \
  | grep -v "Warning\|warn" | tee $OUT/bench_int8_matmul.md | tee -a $LOG
bench int8 400 --warmup 2 --steps 3 \
  --run "lora: pipeline=single $L" \
  --run "lora-int8-compute: pipeline=single $L model.base_compute=int8" \
  --run "lora-fp8-compute: pipeline=single $L model.base_compute=fp8"
