#!/bin/bash
# Device call 3: the stage-0 backward comparison again, with AOTAutograd's donated buffers off
# (call 2's per-output run refused retain_graph=True).
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
cd $REPO
echo "=== stage 0 backward ($(date -u +%T))" | tee -a $LOG
timeout 250 $PY docs/bench-results/h200-1gpu-stage/stage_backward.py 2>&1 | grep "stage0-backward\|Error\|error" | tee -a $LOG
