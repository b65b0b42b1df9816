"""Shared test setup: offline hub, one cache dir per session (tiny models, latents)."""

from __future__ import annotations

import os
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


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


gpu = pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA GPU")


@pytest.hookimpl(wrapper=True)  # runs before xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, keep each module's tests on one worker: their module-scoped fixtures
    (a training run, a SLURM cluster, a tiny model) then run once, not once per worker. A module
    may split further by the values of the parameters it names in GROUP_BY_PARAMS."""
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
