#!/bin/bash
# Call 3 (one H200): HunyuanVideo 13B LoRA with model.attention=flex (its text-padding mask made
# sdpa fall back to a kernel 2.5x slower than flash: attention.py in call 2); the GPU tests of
# flex against sdpa; then attention.py with the flex cases call 2 ran out of time for.
REPO=$PWD
SIZE=13b
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
bench flex 300 --warmup 1 --steps 3 --loader --run "flex: model=hunyuan_video pipeline=single $L model.attention=flex"
(cd $REPO && DPIPE_CACHE=/tmp/cache-t timeout 150 $PY -m pytest -q -p no:cacheprovider -rs \
  tests/gpu/test_gpu.py -k flex > $OUT/gpu-tests.txt 2>&1; echo "pytest rc=$?" >> $OUT/gpu-tests.txt;
  tail -5 $OUT/gpu-tests.txt)
(cd $REPO && timeout 110 $PY docs/bench-results/h200-1gpu-video/attention.py 2>&1 \
  | grep -v Warning | tee $OUT/attention.txt)
