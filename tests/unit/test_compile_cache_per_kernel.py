"""Each SDPA kernel choice compiles into its own inductor cache folder (dpipe.pipeline.attention).

torch.compile's FX-graph and AOTAutograd caches do not key on SDPA's kernel flags (measured on an
H200: docs/bench-results/h200-1gpu-profiles/sdpa_cache.py), so a shared folder would hand a run
with model.attention=cudnn the layers compiled for flash, or the other way round.
"""

from __future__ import annotations

import os

import pytest

from dpipe.pipeline.attention import use_compile_cache_of


@pytest.fixture(autouse=True)
def unset_cache_env(monkeypatch):
    """TORCHINDUCTOR_CACHE_DIR unset, and restored after the test, whatever it sets."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # records the value to restore
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")


def test_each_choice_gets_its_own_folder_under_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    use_compile_cache_of(cudnn=True)
    cudnn = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    use_compile_cache_of(cudnn=False)  # again in this process (or a child): no nesting
    default = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert cudnn != default
    assert os.path.dirname(cudnn) == os.path.dirname(default) == str(tmp_path)


def test_without_a_folder_set_the_choices_go_under_inductors_default():
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    use_compile_cache_of(cudnn=False)
    assert os.path.dirname(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == default_cache_dir()
