#!/bin/bash
# Call 2, after the fixes: every tiny family through the GPU tests (eager sweep) and the 1-GPU
# tests, while two compiled sweeps (halves of the families) run beside them.
D=$(dirname "$0")
ALL=$(python3 -c "from tests.integration.test_families import FAMILIES; print(','.join(FAMILIES))")
A=$(echo $ALL | cut -d, -f1-11); B=$(echo $ALL | cut -d, -f12-)
MODELS=$A LIMIT=540 DPIPE_CACHE=/tmp/cache-a bash $D/families.sh compiled-a pipeline.compile=true &
MODELS=$B LIMIT=540 DPIPE_CACHE=/tmp/cache-b bash $D/families.sh compiled-b pipeline.compile=true &
HF_HUB_OFFLINE=1 DPIPE_CACHE=/tmp/cache-t timeout 560 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/gpu/test_families_gpu.py -k eager tests/gpu/test_gpu.py > $OUT/gpu-tests.txt 2>&1
echo "pytest rc=$?" >> $OUT/gpu-tests.txt
wait
tail -30 $OUT/gpu-tests.txt
