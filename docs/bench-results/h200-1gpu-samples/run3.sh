#!/bin/bash
# One H200: the GPU tests of sampling and of the defaults (whose runs go through the launcher's
# hosted rendezvous store under NCCL).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DPIPE_CACHE=/tmp/dpipe-cache
timeout 560 python3 -m pytest tests/gpu/test_gpu.py -p no:cacheprovider -v -rf \
  -k "samples or defaults" 2>&1 | grep -E "PASSED|FAILED|ERROR|^E |Error|passed|failed" \
  | tail -40 | tee $OUT/gpu-tests.txt
