#!/bin/bash
# For one H200 (written in the twelfth session, not yet run): the first GPU run of the defaults
# model.attention=auto (cuDNN's kernel first on Hopper) and pipeline.compile=null (compiled on a
# GPU). ~9 minutes:
#   ../h200-1gpu-loader-fp8/call.sh 560 run1.sh
# 1. which kernel compiled code runs at the tiny models' shapes (../h200-1gpu-profiles/run5.sh),
# 2. tests/gpu/test_gpu.py, whose checks that leave model.attention and pipeline.compile unset
#    now run cuDNN's kernel, compiled, and test_gpu_defaults_compile_and_pick_the_attention_kernel,
# 3. with what is left, the six families not yet run compiled with cuDNN (run7.sh).
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../h200-1gpu-loader-fp8/common.sh"
bash h200-1gpu-profiles/run5.sh
cd ../..
left() { echo $(( DEADLINE - $(date +%s) - 10 )); }
timeout $(( $(left) < 300 ? $(left) : 300 )) $PY -m pytest tests/gpu/test_gpu.py -k "not two_stage" \
  -p no:cacheprovider -q -rf 2>&1 | tail -25 | tee $OUT/gpu-tests.txt
cd docs/bench-results
GPU_FAMILIES=tiny_sdxl,tiny_auraflow,tiny_flux_kontext,tiny_wan_i2v,tiny_wan22_ti2v,tiny_cosmos_predict2_v2w \
  bash h200-1gpu-cudnn-nan/run7.sh
