#!/bin/bash
# One H200, after run1.sh: whether dpipe's sampler and FluxPipeline compute the same at FLUX.1-dev
# size (fp32, 2 steps), then the bf16 timings again, with dpipe's inputs copied from pinned memory
# and its layers run both plain and under autocast.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DPIPE_CACHE=/tmp/dpipe-cache
B="python3 -m dpipe.bench.sampling --size dev --resolution 1024"
F='Warning|warn|kept in float32'
timeout 120 $B --steps 2 --dtype fp32 2>&1 | grep -Ev "$F" | tee $OUT/bench-fp32.txt
timeout 150 $B --steps 28 2>&1 | grep -Ev "$F" | tee $OUT/bench-eager.txt
timeout 300 $B --steps 28 --compile 2>&1 | grep -Ev "$F" | tail -6 | tee $OUT/bench-compiled.txt
