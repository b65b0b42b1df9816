#!/bin/bash
# For one H200 (eleventh session): with the fix (dpipe.pipeline.attention lays the gradient SDPA's
# backward receives out as its output), the tiny FLUX model's eager cuDNN training (watched: the
# incoming gradients' strides), compute-sanitizer's memcheck again, then the GPU tests of cuDNN.
# Needs .san/ as run3.sh does. Run through call.sh (DEADLINE).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
R=$OUT/fixed.txt
echo "=== eager cuDNN, fixed, watched" | tee $R
timeout 90 $PY -c "
import sys, pathlib; sys.path.insert(0, 'h200-1gpu-cudnn-nan'); import hunt
hunt.train(pathlib.Path('$OUT'), 'cudnn', False, tag='-fixed')" 2>&1 | grep -v WARNING | tail -2 | tee -a $R
python3 - "$OUT" <<'PY' | tee -a $R
import glob, json, sys, collections
seen = collections.Counter()
for path in glob.glob(f"{sys.argv[1]}/watch-cudnn-eager-fixed/calls_*.jsonl"):
    for line in open(path):
        d = json.loads(line)
        if "grad_out" in d:
            seen[(str(d["grad_out"]["shape"]), str(d["grad_out"]["stride"]), str(d["out_stride"]))] += 1
        elif "non_finite" in d:
            seen[("non-finite", d["non_finite"], "")] += 1
for (a, b, c), n in seen.items():
    print(f"{n} x incoming gradient {a} stride {b}; output stride {c}")
PY
python3 -m pip install -q --no-index --no-deps --target /tmp/san ../../.san/nvidia_cuda_sanitizer_api-*.whl
SAN=$(ls /tmp/san/nvidia/cu13/compute-sanitizer/compute-sanitizer)
left=$(( DEADLINE - $(date +%s) - 15 )); [ $left -gt 170 ] && left=170
echo "=== compute-sanitizer --tool memcheck (${left}s), fixed, 2 steps, no caching allocator" | tee -a $R
(cd ../.. && PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $left $SAN --tool memcheck --target-processes all \
  --print-limit 200 --log-file $OUT/memcheck.txt $PY -m dpipe.cli.train hydra.run.dir=/tmp/san-fixed \
  train.progress_bar=false model=tiny_flux dataset=synthetic train.precision=bf16 \
  train.max_steps=2 pipeline.micro_batches=4 train.checkpoint_every_steps=0 pipeline.stages=1 \
  pipeline.data_parallel=1 model.attention=cudnn pipeline.compile=false > $OUT/memcheck-run.txt 2>&1)
echo "exit $?; losses: $(grep -o '"loss": [^,]*' /tmp/san-fixed/metrics.jsonl 2>/dev/null | tr '\n' ' ')" | tee -a $R
grep -E "^=========  *(Invalid|Program hit)" $OUT/memcheck.txt | sort | uniq -c | head -8 | tee -a $R
grep -E "^=========     at " $OUT/memcheck.txt | cut -c1-120 | sort | uniq -c | head -5 | tee -a $R
grep -E "ERROR SUMMARY" $OUT/memcheck.txt | tail -2 | tee -a $R
echo "=== GPU tests of cuDNN" | tee -a $R
(cd ../.. && DPIPE_CACHE=/tmp/cache-t timeout $(( DEADLINE - $(date +%s) - 10 )) $PY -m pytest -q -p no:cacheprovider -rs \
  tests/gpu/test_gpu.py -k cudnn 2>&1 | tail -8) | tee -a $R
