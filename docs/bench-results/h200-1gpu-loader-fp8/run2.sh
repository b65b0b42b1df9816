#!/bin/bash
# Device call 2: fp8 base weights (cast-only upcast) without checkpointing, and with auto
# checkpointing planned for 24 GiB under a 24 GiB allocation cap (a 24 GB card, emulated);
# then the GPU tests.
source "$(dirname "$0")/common.sh"
bench fp8none 150 --warmup 2 --steps 3 --loader --run "lora-1gpu-fp8-compiled: pipeline=single $L model.base_dtype=fp8"
bench fp8auto24 185 --warmup 2 --steps 3 --loader --memory-cap-gb 24 --run "lora-1gpu-fp8-auto-24GiB: pipeline=single $L model.base_dtype=fp8 pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=24"
echo "=== pytest tests/gpu ($(date -u +%T))" | tee -a $LOG
timeout 230 $PY -m pytest tests/gpu -v -rs --durations=0 > $OUT/gpu-tests.txt 2>&1
echo "pytest rc=$?" >> $OUT/gpu-tests.txt
tail -40 $OUT/gpu-tests.txt | tee -a $LOG
