#!/bin/bash
# For one H200 (twelfth session, not yet run), after run1.sh: the rest of tests/gpu/test_gpu.py
# under the new defaults, then the six families not yet run compiled with cuDNN (run7.sh).
# ../h200-1gpu-loader-fp8/call.sh 560 run2.sh (the families may need a call of their own).
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../h200-1gpu-loader-fp8/common.sh"
cd ../..
left() { echo $(( DEADLINE - $(date +%s) - 10 )); }
timeout $(( $(left) < 330 ? $(left) : 330 )) $PY -m pytest tests/gpu/test_gpu.py -p no:cacheprovider -q -rf \
  -k "not (defaults or compiled_blocks_match or one_gpu_step or recompute_as_they_keep or two_stage)" \
  2>&1 | tail -25 | tee $OUT/gpu-tests.txt
cd docs/bench-results
GPU_FAMILIES=tiny_sdxl,tiny_auraflow,tiny_flux_kontext,tiny_wan_i2v,tiny_wan22_ti2v,tiny_cosmos_predict2_v2w \
  bash h200-1gpu-cudnn-nan/run7.sh
