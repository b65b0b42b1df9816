#!/bin/bash
# Call 2 of this session (one H200): HunyuanVideo 13B LoRA with model.attention=flex again, with a
# longer limit than call 3's 300 s and every process's stacks dumped each 100 s (stackdump/), then
# the GPU loss match of flex against sdpa for tiny HunyuanVideo.
REPO=$PWD
SIZE=13b
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
export PYTHONPATH=$REPO/docs/bench-results/h200-1gpu-flex/stackdump:$PYTHONPATH
export DPIPE_STACK_EVERY=100 TORCH_LOGS=recompiles
bench flex 400 --warmup 1 --steps 2 --loader --run "flex: model=hunyuan_video pipeline=single $L model.attention=flex"
export DPIPE_STACK_EVERY=60
(cd $REPO && DPIPE_CACHE=/tmp/cache-t timeout 160 $PY -m pytest -q -p no:cacheprovider -rs \
  "tests/gpu/test_gpu.py::test_flex_attention_trains_as_sdpa_does[tiny_hunyuan_video]" \
  --durations=0 > $OUT/gpu-tests.txt 2>&1; echo "pytest rc=$?" >> $OUT/gpu-tests.txt;
  tail -8 $OUT/gpu-tests.txt)
