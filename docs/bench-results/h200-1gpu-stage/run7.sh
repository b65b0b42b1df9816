#!/bin/bash
# Device call 7: the GPU tests after the bf16-mode data cast (fp32 master weights) and the stage
# balance changes: master weights train like bf16 weights; a one-GPU step makes no host sync.
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
cd $REPO
timeout 400 $PY -m pytest tests/gpu -v -rs --durations=0 -k "master_weights or host_sync" > $OUT/gpu-tests.txt 2>&1
echo "pytest rc=$?" >> $OUT/gpu-tests.txt
tail -12 $OUT/gpu-tests.txt | tee -a $LOG
