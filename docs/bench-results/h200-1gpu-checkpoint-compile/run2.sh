#!/bin/bash
# For one H200 (eleventh session), after the fix (dpipe.pipeline.recompute: compiled layers
# checkpoint inside their compiled graph): run1.sh again, and beside it the GPU test that holds it.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
bash h200-1gpu-checkpoint-compile/run1.sh > $OUT/run1.txt 2>&1 &
(cd ../.. && timeout 280 $PY -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu.py \
  -k "recompute_as_they_keep and tiny_wan" 2>&1 | tail -15) > $OUT/gpu-test.txt
wait
cat $OUT/run1.txt $OUT/gpu-test.txt | cut -c1-300
