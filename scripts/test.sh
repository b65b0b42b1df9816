#!/usr/bin/env bash
# Runs the test suite as CI does. Extra arguments go to pytest.
# As root (CI), it first installs SLURM's Debian packages so the SLURM tests run against a real
# local SLURM (they start and stop it themselves); otherwise those tests skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  bash scripts/slurm/install.sh
  export DPIPE_REQUIRE_SLURM=1
fi
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=25 "$@"
