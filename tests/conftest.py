"""Shared test setup: offline hub, one cache dir per session (tiny models, latents)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

# from_pretrained on a missing path would otherwise retry the hub for ~48 s before failing.
os.environ["HF_HUB_OFFLINE"] = "1"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def dpipe_cache(tmp_path_factory) -> Path:
    """Tiny models and cached latents shared by every test of the session."""
    path = Path(os.environ.get("DPIPE_TEST_CACHE") or tmp_path_factory.mktemp("dpipe-cache"))
    os.environ["DPIPE_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(dpipe_cache) -> Path:
    """Where the tiny model configs make their folders (conf/model/tiny_*.yaml): each folder is
    made once a session and read by every test that uses it (none writes into one)."""
    return dpipe_cache / "models"


@pytest.fixture(scope="module")
def tiny(request, tiny_models) -> Path:
    """The folder of the tiny model config named as the module: conf/model/tiny_<family>.yaml for
    tests/unit/test_tiny_<family>.py, made once a session where that config puts it."""
    from tests.unit.video_checks import tiny_config_spec

    config = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    return tiny_config_spec(tiny_models, config).path


def pytest_configure(config):
    """Each xdist worker's own torch work gets its share of the cores: with torch's default of
    every core per worker, two workers' in-process tests (and the training processes they start)
    oversubscribe the CI machine's 2 cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


gpu = pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA GPU")


# Modules by the seconds they take on a 2-core machine (measured 2026-12-07 at 57ac0f4, rounded):
# the workers take them longest first, so neither is left running a long module alone at the end.
# scripts/test.sh passes --no-loadscope-reorder so that xdist queues modules in collection order:
# its own order (most tests first) queued the long few-test modules last, e.g. SLURM's 4 tests
# of ~5 min. Only the order matters; a module not named here runs after these, most tests first.
SLOWEST_MODULES = {
    "tests.integration.test_families": 340,
    "tests.integration.test_documented_commands": 500,  # its larger half (family pages)
    "tests.integration.test_slurm_two_nodes": 175,  # one test, the two nodes' start included
    "tests.integration.test_samples": 100,
    "tests.integration.test_flux_kontext_edit": 90,
    "tests.integration.test_video_clips": 80,
    "tests.integration.test_graceful_stop": 80,
    "tests.integration.test_slurm": 75,
    "tests.integration.test_reexport": 75,
    "tests.integration.test_training": 70,
    "tests.integration.test_bench": 70,
    "tests.integration.test_adapters": 65,
    "tests.unit.test_docs_commands": 60,
    "tests.integration.test_optimizers": 60,
    "tests.unit.test_config": 55,
    "tests.integration.test_sweeps": 50,
    "tests.integration.test_data_training": 50,
    "tests.unit.test_step_flops": 50,
    "tests.integration.test_quick_start": 40,
}


def _longest_modules_first(items) -> None:
    """Sorts `items` by module (SLOWEST_MODULES, then most tests), each module's in their order."""
    names = [getattr(getattr(item, "module", None), "__name__", "") for item in items]
    counts = Counter(names)
    keys = {id(item): (-SLOWEST_MODULES.get(name, 0), -counts[name], name, i)
            for i, (item, name) in enumerate(zip(items, names))}
    items.sort(key=lambda item: keys[id(item)])


@pytest.hookimpl(wrapper=True)  # runs before xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, keep each module's tests on one worker: their module-scoped fixtures
    (a training run, a SLURM cluster, a tiny model) then run once, not once per worker. A module
    may split further by the values of the parameters it names in GROUP_BY_PARAMS. The longest
    modules come first (SLOWEST_MODULES), so that both workers stay busy to the end."""
    if hasattr(config, "workerinput"):  # an xdist worker: its collection order is the queue's
        _longest_modules_first(items)
    for item in items:
        if getattr(item, "module", None) is None:
            continue
        group = item.module.__name__
        params = getattr(getattr(item, "callspec", None), "params", {})
        for name in getattr(item.module, "GROUP_BY_PARAMS", ()):
            if name in params:
                group += f":{params[name]}"  # no "]": xdist reads a group after the last "]"
        item.add_marker(pytest.mark.xdist_group(group))
    yield
