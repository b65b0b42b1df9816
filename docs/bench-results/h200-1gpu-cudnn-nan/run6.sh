#!/bin/bash
# For one H200 (written in the eleventh session, not yet run): half of the tiny families compiled
# with the default kernels and with cuDNN's (each choice in its own inductor cache folder), the
# last check before cuDNN's kernel can be the default. Usage, one call per half:
#   HALF=0 call.sh 560 run6.sh ; HALF=1 call.sh 560 run6.sh
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
cd ../..
export GPU_FAMILIES=$($PY -c "from tests.integration.test_families import FAMILIES as F; print(','.join(F[${HALF:-0}::2]))")
echo "families: $GPU_FAMILIES" | tee $OUT/compiled-$HALF.txt
timeout $(( DEADLINE - $(date +%s) - 10 )) $PY -m pytest -q -p no:cacheprovider -rf \
  tests/gpu/test_families_gpu.py -k "cudnn-compiled" 2>&1 | tail -30 | tee -a $OUT/compiled-$HALF.txt
