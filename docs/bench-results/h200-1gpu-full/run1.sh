#!/bin/bash
# Device call 1 (2026-12-01, second session): the GPU tests that train through dpipe-train (its
# workers now forked from the launcher's fork server), then a full fine-tune of FLUX.1-dev on ONE
# H200 (bf16 weights and AdamW states, auto activation checkpointing) with the plain full
# fine-tune loop (compiled blocks, no checkpointing) as the reference.
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
F="train.precision=bf16 pipeline.micro_batches=8 pipeline.compile=true"
echo "=== pytest tests/gpu ($(date -u +%T))" | tee -a $LOG
(cd $REPO && timeout 200 $PY -m pytest tests/gpu -v -rs --durations=0 \
  -k "compiled_blocks or auto_checkpointing" > $OUT/gpu-tests.txt 2>&1; echo "pytest rc=$?" >> $OUT/gpu-tests.txt)
tail -8 $OUT/gpu-tests.txt | tee -a $LOG
bench full1 370 --warmup 2 --steps 3 --loader --plain --run "full-1gpu-auto: pipeline=single $F model.mode=full optim.master_weights=false pipeline.activation_checkpointing=auto"
