#!/usr/bin/env bash
# Creates .venv with dpipe and its dependencies; fast when nothing changed.
#   DPIPE_TORCH   the torch requirement to install first (default: torch==2.13.0, the CPU build
#                 this project's CI uses). On a GPU machine install the torch build for your CUDA
#                 first, or set e.g. DPIPE_TORCH="torch==2.11.0" with your index URL in PIP_INDEX_URL.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
"$PYTHON" - <<'PY' || { echo "dpipe needs Python >= 3.10 (found $("$PYTHON" --version 2>&1))" >&2; exit 1; }
import sys; sys.exit(sys.version_info < (3, 10))
PY

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi

stamp=.venv/.dpipe-setup
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

# torch first: an unpinned torch pulled in by deepspeed/peft would be a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing ${DPIPE_TORCH:-torch==2.13.0}"
  .venv/bin/python -m pip install -q "${DPIPE_TORCH:-torch==2.13.0}"
fi
echo "[setup] installing dpipe and its dependencies"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import dpipe, deepspeed, diffusers, hydra" \
  || { echo "[setup] the install failed; see the messages above" >&2; exit 1; }
echo "$want" > "$stamp"
echo "[setup] ready: $(.venv/bin/python -c 'import torch, deepspeed, diffusers; print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, diffusers {diffusers.__version__}")')"
