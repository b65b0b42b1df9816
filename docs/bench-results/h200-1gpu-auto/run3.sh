#!/bin/bash
# For one H200 (written in the thirteenth session, not yet run): why the tiny FLUX full
# fine-tune went NaN under the then-defaults (compiled, cuDNN first; call3-out), then the GPU
# tests that have not run under the current defaults. ~9 minutes: ../h200-1gpu-loader-fp8/call.sh 560 run3.sh
# pytest gets SIGINT at its deadline, so it still prints which tests failed and why.
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../h200-1gpu-loader-fp8/common.sh"
cd ../..
left() { echo $(( DEADLINE - $(date +%s) - 15 )); }
# 1. Six full fine-tunes, 2 steps each: bf16 or master weights x sdpa compiled, cuDNN eager,
#    cuDNN compiled. A run that diverges now ends with dpipe's error, whose text is printed.
timeout -s INT -k 10 240 $PY $HERE/nan_full.py 2>&1 | grep -v -i warn | tee $OUT/nan_full.txt
# 2. The GPU tests: the defaults test, then the ones the twelfth session's calls did not reach.
timeout -s INT -k 10 $(left) $PY -m pytest tests/gpu/test_gpu.py -p no:cacheprovider -v -rf \
  -k "defaults or full_fine_tune or auto_checkpointing or fp8 or cudnn_attention or flex" \
  2>&1 | grep -E "PASSED|FAILED|ERROR|^E |Error|passed|failed" | tee $OUT/gpu-tests.txt
