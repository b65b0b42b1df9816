#!/bin/bash
# Every tiny model family trains 2 steps on one GPU (bf16, LoRA, 1 stage, 2 micro-batches, the
# loader's worker processes); prints each run's audited step: host syncs, backward passes per
# micro-batch. Usage: families.sh TAG [OVERRIDES...]
set -u
TAG=$1; shift
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DPIPE_CACHE=${DPIPE_CACHE:-/tmp/dpipe-cache}
MODELS=${MODELS:-$(python3 -c "from tests.integration.test_families import FAMILIES; print(','.join(FAMILIES))")}
SWEEP=/tmp/families-$TAG
timeout ${LIMIT:-420} python3 -m dpipe.cli.train -m hydra.sweep.dir=$SWEEP "model=$MODELS" \
  dataset=synthetic pipeline=single train.precision=bf16 train.max_steps=2 \
  pipeline.micro_batches=2 train.checkpoint_every_steps=0 train.progress_bar=false "$@" \
  > $OUT/$TAG-sweep.log 2>&1
echo "sweep rc=$?" > $OUT/$TAG.txt
python3 - "$SWEEP" >> $OUT/$TAG.txt <<'PY'
import json, sys
from pathlib import Path
summary = Path(sys.argv[1]) / "sweep_summary.json"
if summary.is_file():
    points = json.loads(summary.read_text())["points"]
else:  # the sweep ran out of time: the points it reached
    import yaml
    points = [{"overrides": yaml.safe_load((d / ".hydra/overrides.yaml").read_text()),
               "status": "no summary", "run_dir": str(d)}
              for d in sorted(Path(sys.argv[1]).iterdir()) if (d / ".hydra").is_dir()]
for p in points:
    model = next(o for o in p["overrides"] if o.startswith("model="))
    line = f"{model:36s} {p['status']:10s}"
    m = Path(p["run_dir"]) / "metrics.jsonl"
    if m.is_file():
        rows = [json.loads(x) for x in m.read_text().splitlines()]
        audited = [r for r in rows if "host_syncs" in r]
        if audited:
            a = audited[0]
            line += f" host syncs {a['host_syncs']:4d}  backward passes {a['backward_passes_per_micro_batch']:g}"
        line += f"  losses {[round(r['loss'], 4) for r in rows]}  step s {[round(r['step_time_s'], 3) for r in rows]}"
    else:
        line += " " + (p.get("message") or "")[:300].replace("\n", " ")
    print(line)
PY
cat $OUT/$TAG.txt
