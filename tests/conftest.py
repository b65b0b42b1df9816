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
