#!/usr/bin/env bash
# Runs the test suite as CI does. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
