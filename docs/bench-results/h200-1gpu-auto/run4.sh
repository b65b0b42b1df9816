#!/bin/bash
# For one H200 (fourteenth session): the GPU defaults test, never run before (a LoRA and a full
# fine-tune of the tiny FLUX, each under pipeline.compile=null and model.attention=auto); one
# guess at call 4's finding (the tiny full fine-tune's gradients are NaN compiled with cuDNN's
# kernel, finite eager with it and compiled with flash): the same run with AOTAutograd's
# buffer donation off; then the last two families not yet run compiled with cuDNN (Wan 2.2
# TI2V, then SDXL, whose compile has taken up to 270 s). ../h200-1gpu-loader-fp8/call.sh 560 run4.sh
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../h200-1gpu-loader-fp8/common.sh"
cd ../..
left() { echo $(( DEADLINE - $(date +%s) - 15 )); }
timeout -s INT -k 10 $(( $(left) < 240 ? $(left) : 240 )) $PY -m pytest tests/gpu/test_gpu.py \
  -p no:cacheprovider -v -rf -k defaults 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|^E |Error|passed|failed" | tee $OUT/gpu-tests.txt
# Every Python process of the run (the launcher's workers too) reads sitecustomize.
mkdir -p /tmp/no-donation
echo "import torch._functorch.config as c; c.donated_buffer = False" > /tmp/no-donation/sitecustomize.py
PYTHONPATH=/tmp/no-donation:$PYTHONPATH timeout -s INT -k 10 100 $PY $HERE/nan_full.py \
  "plain cudnn compiled" 2>&1 | grep -E "^plain|^error" | tee $OUT/nan_no_donation.txt
cd docs/bench-results
for family in tiny_wan22_ti2v tiny_sdxl; do
  OUT=$OUT/$family; mkdir -p $OUT
  GPU_FAMILIES=$family bash h200-1gpu-cudnn-nan/run7.sh
  OUT=$(dirname $OUT)
done
