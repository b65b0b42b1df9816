#!/bin/bash
# For one H200 (eleventh session): does cuDNN's NaN depend on the token count (tiny FLUX, 64
# image tokens + T5 length), on asynchrony (CUDA_LAUNCH_BLOCKING), and does compute-sanitizer
# (memcheck: out-of-bounds accesses; initcheck: reads of memory never written) name a kernel?
# Needs the nvidia-cuda-sanitizer-api wheel (it holds compute-sanitizer) in .san/, apart from the
# wheels of .whl/ that go on PYTHONPATH. Run through call.sh (DEADLINE).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
R=$OUT/tokens.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R
tiny() {  # tiny LIMIT TAG EXTRA-OVERRIDES...: the tiny FLUX model, eager cuDNN, its losses
  local limit=$1 tag=$2; shift 2
  local extra=""; [ $# -gt 0 ] && extra=$(printf "'%s'," "$@")
  timeout $limit $PY -c "
import sys, pathlib; sys.path.insert(0, 'h200-1gpu-cudnn-nan'); import hunt
hunt.train(pathlib.Path('$OUT'), 'cudnn', False, ${extra} tag='$tag', watch=False)" 2>&1 \
    | grep -v WARNING | tail -2 | tee -a $R
}
for t in 32 40 64 96 192; do
  echo "=== T5 tokens $t: $((64 + t)) tokens in all" | tee -a $R
  tiny 60 "-t$t" model.max_text_tokens=$t
done
echo "=== 96 tokens, CUDA_LAUNCH_BLOCKING=1" | tee -a $R
CUDA_LAUNCH_BLOCKING=1 tiny 60 -blocking
echo "=== 96 tokens, sdpa (flash) for comparison" | tee -a $R
timeout 60 $PY -c "
import sys, pathlib; sys.path.insert(0, 'h200-1gpu-cudnn-nan'); import hunt
hunt.train(pathlib.Path('$OUT'), 'sdpa', False, tag='-flash', watch=False)" 2>&1 | grep -v WARNING | tail -2 | tee -a $R
python3 -m pip install -q --no-index --no-deps --target /tmp/san ../../.san/nvidia_cuda_sanitizer_api-*.whl
SAN=$(ls /tmp/san/nvidia/cu13/compute-sanitizer/compute-sanitizer)
for tool in memcheck initcheck; do
  left=$(( DEADLINE - $(date +%s) - 20 ))
  [ $left -lt 60 ] && { echo "=== skip $tool: ${left}s left" | tee -a $R; continue; }
  [ $tool = memcheck ] && [ $left -gt 220 ] && left=220
  echo "=== compute-sanitizer --tool $tool (${left}s), 96 tokens, 2 steps, no caching allocator" | tee -a $R
  (cd ../.. && PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $left $SAN --tool $tool --target-processes all \
    --print-limit 200 --log-file $OUT/$tool.txt $PY -m dpipe.cli.train hydra.run.dir=/tmp/san-$tool \
    train.progress_bar=false model=tiny_flux dataset=synthetic train.precision=bf16 \
    train.max_steps=2 pipeline.micro_batches=4 train.checkpoint_every_steps=0 pipeline.stages=1 \
    pipeline.data_parallel=1 model.attention=cudnn pipeline.compile=false > $OUT/$tool-run.txt 2>&1)
  echo "exit $?; losses: $(grep -o '"loss": [^,]*' /tmp/san-$tool/metrics.jsonl 2>/dev/null | tr '\n' ' ')" | tee -a $R
  grep -E "^=========  *(Invalid|Uninitialized|Program hit)" $OUT/$tool.txt | sort | uniq -c | head -8 | tee -a $R
  grep -E "^=========  *(in |Device Frame|.*kernel)" $OUT/$tool.txt | sed 's/0x[0-9a-f]*/X/g' | sort | uniq -c | sort -rn | head -10 | tee -a $R
  grep -E "ERROR SUMMARY" $OUT/$tool.txt | tail -2 | tee -a $R
done
