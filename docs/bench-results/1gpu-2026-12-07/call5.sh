#!/bin/bash
# Device call 5 (2026-12-07, one GPU, for a short budget): the GPU tests changed on 2026-12-06,
# the int8 compute GPU tests (2026-12-07), tiny LTX-2.3 with sound compiled (its host syncs), Krea 2 12B at 1024^2 (its host syncs).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-400} ))
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $LOG
echo "=== GPU tests ($(date -u +%T))" | tee -a $LOG
(cd ../.. && timeout 150 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_base_compute_gpu.py \
  "tests/gpu/test_gpu.py::test_the_default_pipeline_runs_one_stage_on_one_gpu" 2>&1 \
  | grep -E "assert|passed|failed|Error|skipped" | head -30) | tee -a $LOG
SIZE=tiny bench ltxav-tiny 70 --warmup 2 --steps 1 \
  --run "av: model=tiny_ltx23 model.audio=true pipeline=single train.precision=bf16 pipeline.micro_batches=4 pipeline.compile=true"
SIZE=12b bench krea2 130 --warmup 1 --steps 1 --run "lora: model=krea2 pipeline=single $L"
