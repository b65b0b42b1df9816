#!/usr/bin/env bash
# Runs the test suite as CI does. Extra arguments go to pytest.
# Tests run in parallel on every core (pytest-xdist; DPIPE_TEST_WORKERS=N to choose, 0 for none):
# most of a multi-process test's time is single-threaded start-up, so 2 cores run 2 at once well.
# Each module's tests stay on one worker (tests/conftest.py), so shared runs happen once, and the
# longest modules start first (conftest.SLOWEST_MODULES; --no-loadscope-reorder keeps that order).
# As root (CI), it first installs SLURM's Debian packages so the SLURM tests run against a real
# local SLURM (they start and stop it themselves); otherwise those tests skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  bash scripts/slurm/install.sh
  export DPIPE_REQUIRE_SLURM=1
fi
workers=${DPIPE_TEST_WORKERS:-$(nproc)}
[ "$workers" -gt 8 ] && workers=8
parallel=()
[ "$workers" -gt 0 ] && parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
# The two-node SLURM job array and the external requeue (cluster_full) take longer than CI
# allows: make test-cluster.
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=25 \
  -m "not cluster_full" \
  "${parallel[@]}" "$@"
