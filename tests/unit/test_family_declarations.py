"""Every family's declarations name what exists: a misspelt "module:name" or class name would
otherwise surface only when a run first reaches it (the tiny writer on a fresh cache, the sampler
at the first sample round, the LoRA writer at the export), minutes into a run."""

from __future__ import annotations

import importlib
import inspect

import pytest

from dpipe.models.family import DiffusersFamily, diffusers_class, imported
from dpipe.models.registry import FAMILIES


def _spec_class(family: str) -> type:
    module, name = FAMILIES[family].split(":")
    return getattr(importlib.import_module(module), name)


DECLARING = sorted(f for f in FAMILIES if issubclass(_spec_class(f), DiffusersFamily))


def test_every_family_is_on_the_shared_base():
    assert DECLARING == sorted(FAMILIES)


def _own(spec: type, method: str) -> bool:
    """Whether the family writes `method` itself instead of inheriting the base's."""
    return getattr(spec, method) is not getattr(DiffusersFamily, method)


@pytest.mark.parametrize("family", DECLARING)
def test_declarations_name_what_exists(family):
    # A declaration is checked where the base uses it: a family that writes the method that
    # reads it (SDXL's ensure_available, the layers that take the attention kernel) needs none.
    spec = _spec_class(family)
    assert spec.family == family
    if not _own(spec, "ensure_available"):
        assert callable(imported(spec.tiny_writer)), spec.tiny_writer
    if spec.sampler is not None:
        assert callable(imported(spec.sampler)), spec.sampler
    if not _own(spec, "load_denoiser"):
        assert inspect.isclass(diffusers_class(spec.denoiser_class)), spec.denoiser_class
    if spec.lora_writer is not None:
        assert inspect.isclass(diffusers_class(spec.lora_writer)), spec.lora_writer
    if isinstance(getattr(spec, "pipeline_class", None), str):  # a property where it is read
        assert inspect.isclass(diffusers_class(spec.pipeline_class)), spec.pipeline_class
    if not _own(spec, "pipeline_layers"):
        assert callable(spec.layers)
    assert all(inspect.isclass(t) for t in spec.block_types)


def test_a_misspelt_declaration_fails_here(monkeypatch):
    spec = _spec_class("ernie_image")
    monkeypatch.setattr(spec, "sampler", "dpipe.models.ernie_image.sampling:ErnieSampling")
    with pytest.raises(AttributeError):
        test_declarations_name_what_exists("ernie_image")
