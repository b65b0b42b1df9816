#!/bin/bash
# Device call 8: the other GPU tests (auto checkpointing, fp8 base weights) with the stage engine.
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
cd $REPO
timeout 540 $PY -m pytest tests/gpu -v -rs --durations=0 -k "auto or fp8" > $OUT/gpu-tests.txt 2>&1
echo "pytest rc=$?" >> $OUT/gpu-tests.txt
tail -14 $OUT/gpu-tests.txt | tee -a $LOG
