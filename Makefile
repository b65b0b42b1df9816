# The two commands of the quick start (see README.md). Both set everything up first.
.PHONY: setup demo test test-fast test-docs test-cluster

setup:
	@bash scripts/setup.sh

# Trains the tiny FLUX-architecture model on a generated dataset, 2 pipeline stages in 2 CPU
# processes, sampling as it goes; outputs land in outputs/tiny_flux-synthetic/.
demo: setup
	HF_HUB_OFFLINE=1 .venv/bin/dpipe-train train=demo sample=demo

# The whole suite, as CI runs it (starts a local SLURM for the SLURM tests when it can). As
# root with apt, SLURM's packages install while setup installs Python's (both take a minute or
# two on a fresh machine); scripts/test.sh checks them again and says what failed.
test:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  bash scripts/slurm/install.sh > .slurm-install.log 2>&1 & slurm=$$!; fi; \
	bash scripts/setup.sh || exit 1; \
	[ -z "$${slurm:-}" ] || wait $$slurm || true
	bash scripts/test.sh

# The unit tests not marked slow (827 of 1089), on every core: 89 s on 2 cores (2026-12-05).
test-fast: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/unit -q -p no:cacheprovider -m "not slow" -n auto

# Every documented command, end to end on tiny models (make test runs them too):
# tests/integration/test_documented_commands.py and the tests it leaves three of them to.
test-docs: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/integration/test_documented_commands.py tests/integration/test_sweeps.py::test_the_documented_sweep_runs_as_written tests/integration/test_quick_start.py tests/integration/test_slurm.py::test_sweep_runs_as_a_job_array_of_two_task_jobs -q -p no:cacheprovider

# Every SLURM test, cluster_full too (two-node job array, external requeue): as root with
# apt, on a local SLURM of two network-namespace nodes (tests/integration/test_slurm_two_nodes.py).
test-cluster: setup
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then bash scripts/slurm/install.sh; fi
	HF_HUB_OFFLINE=1 DPIPE_REQUIRE_SLURM=1 .venv/bin/python -m pytest tests/integration/test_slurm.py tests/integration/test_slurm_two_nodes.py -q -p no:cacheprovider
