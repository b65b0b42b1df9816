#!/bin/bash
# Device call 4: the stage-0 backward comparison, eager (compiled, the per-output loop failed);
# then compiled, one pass only (the path StageEngine takes on a first stage).
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
cd $REPO
echo "=== stage 0 backward, eager ($(date -u +%T))" | tee -a $LOG
timeout 250 $PY docs/bench-results/h200-1gpu-stage/stage_backward.py 2>&1 | grep "stage0-backward\|Error\|error" | tee -a $LOG
echo "=== stage 0 backward, compiled, one pass only ($(date -u +%T))" | tee -a $LOG
timeout 250 $PY docs/bench-results/h200-1gpu-stage/stage_backward.py --compile --one-pass-only 2>&1 | grep "stage0-backward\|Error\|error" | tee -a $LOG
