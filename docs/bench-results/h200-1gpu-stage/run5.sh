#!/bin/bash
# Device call 5: the stage-0 backward comparison, eager and compiled, cuDNN attention off.
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
cd $REPO
for flag in "" --compile; do
  echo "=== stage 0 backward $flag ($(date -u +%T))" | tee -a $LOG
  timeout 250 $PY docs/bench-results/h200-1gpu-stage/stage_backward.py $flag 2>&1 | grep "stage0-backward\|Error\|error" | tee -a $LOG
done
