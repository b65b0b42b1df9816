#!/bin/bash
# For one H200 (twelfth session): dpipe's per-choice inductor cache folders
# (dpipe.pipeline.attention.use_compile_cache_of). Three processes share one cache folder, as two
# runs on one machine do: default kernels, then cuDNN's, then default again; each should run its
# own choice's kernels (run3.sh showed the second ran the first's without the folders).
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../h200-1gpu-loader-fp8/common.sh"
cd ../..
for order in flash cudnn flash; do
  echo "--- sdpa_cache.py --dpipe $order (TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-dpipe)" | tee -a $OUT/cache.txt
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-dpipe timeout 90 $PY $HERE/sdpa_cache.py --dpipe $order 2>&1 \
    | grep -v Warning | tee -a $OUT/cache.txt
done
