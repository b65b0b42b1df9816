# Sourced by the device scripts: environment, and bench helpers that keep only results in $OUT.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DPIPE_CACHE=${DPIPE_CACHE:-/tmp/dpipe-cache}
SIZE=${SIZE:-dev}
PY=${PY:-python3}
# Scripts before 2026-12-03 (commit 6417d8a) ran with the then-default attention kernels (flash); the
# default since, model.attention=auto, is cuDNN's on Hopper: add model.attention=sdpa for flash.
L="train.precision=bf16 pipeline.micro_batches=8 pipeline.compile=true model.lora.rank=32 model.lora.alpha=32"
LOG=$OUT/log.txt
bench() {  # bench TAG TIMEOUT ARGS... : results to $OUT/TAG.md / .json
  local tag=$1 limit=$2; shift 2
  if [ -n "${DEADLINE:-}" ]; then  # DEADLINE (epoch s): a call's end; a bench that cannot start skips
    local left=$(( DEADLINE - $(date +%s) ))
    if [ $left -lt ${MIN_LEFT:-90} ]; then echo "=== skip $tag: ${left}s left" | tee -a $LOG; return; fi
    [ $left -lt $limit ] && limit=$left
  fi
  echo "=== bench $tag: $* ($(date -u +%T))" | tee -a $LOG
  timeout $limit $PY -m dpipe.cli.bench --size $SIZE --out /tmp/bench-$tag "$@" 2>&1 \
    | grep -v "WARNING\|^SEED_LAYERS\|^Using topology" | tee -a $LOG
  cp /tmp/bench-$tag/results.md $OUT/$tag.md 2>/dev/null
  cp /tmp/bench-$tag/results.json $OUT/$tag.json 2>/dev/null
  echo "=== end $tag ($(date -u +%T))" | tee -a $LOG
}
