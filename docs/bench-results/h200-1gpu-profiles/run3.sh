#!/bin/bash
# For one H200 (ninth session), after model.attention=sdpa became cuDNN-first on Hopper: SDPA's
# kernels timed again, with a key-padding mask too (sdpa.py); whether torch.compile's caches key
# on SDPA's flags (sdpa_cache.py: the second process shares the first's inductor cache, the
# fourth has the caches off); then the GPU tests with the new default. ~9 minutes:
# `../h200-1gpu-loader-fp8/call.sh 570 run3.sh`.
REPO=$PWD
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../h200-1gpu-loader-fp8/common.sh"
timeout 90 $PY $HERE/sdpa.py 2>&1 | grep -v Warning | tee -a $LOG
for arm in "a flash" "a cudnn" "b cudnn flash" "c flash cudnn"; do
  set -- $arm; dir=/tmp/inductor-$1; shift
  caches=1; [ $dir = /tmp/inductor-c ] && caches=0  # c: FX graph and AOTAutograd caches off
  echo "--- sdpa_cache.py $* (TORCHINDUCTOR_CACHE_DIR=$dir, caches $caches)" | tee -a $LOG
  TORCHINDUCTOR_FX_GRAPH_CACHE=$caches TORCHINDUCTOR_AUTOGRAD_CACHE=$caches \
    TORCHINDUCTOR_CACHE_DIR=$dir timeout 60 $PY $HERE/sdpa_cache.py "$@" 2>&1 | grep -v Warning | tee -a $LOG
done
cd $REPO
left() { echo $(( DEADLINE - $(date +%s) - 10 )); }
timeout $(left) $PY -m pytest tests/gpu/test_gpu.py -k "not two_stage" -p no:cacheprovider -q 2>&1 | tail -25 | tee -a $LOG
timeout $(left) $PY -m pytest tests/gpu/test_families_gpu.py -k eager -p no:cacheprovider -q 2>&1 | tail -25 | tee -a $LOG
