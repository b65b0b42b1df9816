#!/bin/bash
# One H200: dpipe's sampler against FluxPipeline at FLUX.1-dev size (random weights, 1024^2,
# 28 steps, guidance 3.5, bf16), eager and compiled; then the GPU tests of sampling and of the
# defaults (which go through the launcher's hosted rendezvous store under NCCL).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DPIPE_CACHE=/tmp/dpipe-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 170 python3 -m dpipe.bench.sampling --size dev --steps 28 --resolution 1024 2>&1 \
  | grep -v "Warning\|warn" | tee $OUT/bench-eager.txt
timeout 250 python3 -m dpipe.bench.sampling --size dev --steps 28 --resolution 1024 --compile 2>&1 \
  | grep -v "Warning\|warn" | tail -8 | tee $OUT/bench-compiled.txt
timeout 160 python3 -m pytest tests/gpu/test_gpu.py -p no:cacheprovider -q -rf \
  -k "samples or defaults" 2>&1 | tail -25 | tee $OUT/gpu-tests.txt
