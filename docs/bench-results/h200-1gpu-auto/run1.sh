#!/bin/bash
# For one H200 (written in the twelfth session, not yet run): the first GPU run of the defaults
# model.attention=auto (cuDNN's kernel first on Hopper) and pipeline.compile=null (compiled on a
# GPU). ~9 minutes: ../h200-1gpu-loader-fp8/call.sh 560 run1.sh
# 1. which kernel compiled code runs at the tiny models' shapes (../h200-1gpu-profiles/run5.sh),
# 2. the GPU tests the new defaults touch most: the defaults themselves (from the run's log),
#    compiled vs eager, the host-sync audit, compiled recompute.
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../h200-1gpu-loader-fp8/common.sh"
bash h200-1gpu-profiles/run5.sh
cd ../..
timeout $(( DEADLINE - $(date +%s) - 10 )) $PY -m pytest tests/gpu/test_gpu.py -p no:cacheprovider -q -rf \
  -k "defaults or compiled_blocks_match or one_gpu_step or recompute_as_they_keep" 2>&1 | tail -25 \
  | tee $OUT/gpu-tests.txt
