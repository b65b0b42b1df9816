#!/bin/bash
# Device call 6: compiled, one pass only (StageEngine's path, donated buffers left on), then
# compiled with both ways and CUDA_LAUNCH_BLOCKING=1 to see where call 5's illegal access was.
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
cd $REPO
echo "=== stage 0 backward --compile --one-pass-only ($(date -u +%T))" | tee -a $LOG
timeout 200 $PY docs/bench-results/h200-1gpu-stage/stage_backward.py --compile --one-pass-only 2>&1 | grep "stage0-backward\|Error\|error" | tee -a $LOG
echo "=== stage 0 backward --compile, CUDA_LAUNCH_BLOCKING=1 ($(date -u +%T))" | tee -a $LOG
CUDA_LAUNCH_BLOCKING=1 timeout 200 $PY docs/bench-results/h200-1gpu-stage/stage_backward.py --compile > $OUT/compile-both.txt 2>&1
grep -v "WARNING" $OUT/compile-both.txt | grep -B2 -A3 "Error\|stage0-backward" | tail -40 | tee -a $LOG
