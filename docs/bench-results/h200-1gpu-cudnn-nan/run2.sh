#!/bin/bash
# For one H200 (tenth session): cuDNN's backward after NaN-filled free memory (poison.py), then
# the tiny FLUX eager cuDNN training again with the caching allocator off (fresh cudaMalloc).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
timeout 240 $PY h200-1gpu-cudnn-nan/poison.py 2>&1 | grep -v WARNING | tee $OUT/poison.txt
echo "=== no caching allocator" | tee -a $OUT/poison.txt
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 $PY -c "
import sys, pathlib; sys.path.insert(0, 'h200-1gpu-cudnn-nan'); import hunt
hunt.train(pathlib.Path('$OUT'), 'cudnn', False)" 2>&1 | grep -v WARNING | tail -3 | tee -a $OUT/poison.txt
