#!/bin/bash
# For one H200 (eleventh session): with the fix, every tiny family trained eager with the default
# kernels and with cuDNN's (tests/gpu/test_families_gpu.py, not compiled), then each run's losses.
# Run through call.sh (DEADLINE).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
R=$OUT/families.txt
(cd ../.. && timeout $(( DEADLINE - $(date +%s) - 20 )) $PY -m pytest -q -p no:cacheprovider -rf \
  --basetemp=/tmp/fam tests/gpu/test_families_gpu.py -k "not compiled" 2>&1 | tail -30) | tee $R
python3 - <<'PY' | tee -a $R
import json, pathlib, collections
rows = collections.defaultdict(dict)
for m in sorted(pathlib.Path("/tmp/fam").glob("*/**/metrics.jsonl")):
    mode = next(p.name.rsplit("-", 1)[0] for p in m.parents if p.parent.name == "fam")
    model = next(o for o in (m.parent / ".hydra/overrides.yaml").read_text().split() if "model=" in o)
    rows[model.split("=")[1]][mode] = [round(json.loads(x)["loss"], 5) for x in m.read_text().splitlines()]
for model, modes in rows.items():
    print(f"{model:28s} " + "  ".join(f"{k} {v}" for k, v in sorted(modes.items())))
PY
