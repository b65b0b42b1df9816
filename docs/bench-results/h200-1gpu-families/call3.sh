#!/bin/bash
# Call 3: the 1-GPU tests, beside compiled sweeps of the families call 2 did not reach.
D=$(dirname "$0")
MODELS=tiny_sdxl LIMIT=540 DPIPE_CACHE=/tmp/cache-a bash $D/families.sh compiled-c pipeline.compile=true &
MODELS=tiny_hunyuan_image,tiny_hidream,tiny_sd3,tiny_chroma LIMIT=540 DPIPE_CACHE=/tmp/cache-b \
  bash $D/families.sh compiled-d pipeline.compile=true &
HF_HUB_OFFLINE=1 DPIPE_CACHE=/tmp/cache-t timeout 540 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/gpu/test_gpu.py > $OUT/gpu-tests.txt 2>&1
echo "pytest rc=$?" >> $OUT/gpu-tests.txt
wait
tail -30 $OUT/gpu-tests.txt
