#!/bin/bash
# Device call 2 (2026-12-06, one H100): the fp8 gradient test as corrected; tiny LTX-2.3 with
# sound, compiled, with dynamo's recompiles and graph breaks logged (call 1: its first step took
# 82 s and 16,537 host syncs, against 30 s and 494 without sound); the flux_lora_16gb preset under
# a 16 GiB cap with the block-swap fix.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
echo "=== fp8 grad test ($(date -u +%T))" | tee -a $LOG
(cd ../.. && timeout 90 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_base_compute_gpu.py -k "align and fp8" 2>&1 | grep -E "assert|passed|failed|Error" | head -20) | tee -a $LOG
TORCH_LOGS=recompiles,graph_breaks SIZE=tiny bench ltxav-tiny 170 --warmup 2 --steps 1 \
  --run "av: model=tiny_ltx23 model.audio=true pipeline=single train.precision=bf16 pipeline.micro_batches=4 pipeline.compile=true"
SIZE=dev bench flux16 240 --warmup 1 --steps 1 --memory-cap-gb 16 \
  --run "flux_lora_16gb: experiment=flux_lora_16gb $L"
