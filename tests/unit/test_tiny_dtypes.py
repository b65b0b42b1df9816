"""Every tiny model (conf/model/tiny_*.yaml) loads as its real repo does with default arguments.

A pipeline's `from_pretrained` without a dtype loads each component with its class's own default:
transformers 5 in the dtype its config states, diffusers in float32. So what a user meets on
loading a tiny model with no arguments depends on each text encoder's config agreeing with its
stored weights, as in the real repos (FLUX.1-dev: bf16 weights, configs saying bfloat16). Checked
here per component, for every tiny config: the config's stated dtype is the weights' dtype, the
loaded parameters have it (float32 for diffusers models), and a text encoder runs in it.
A pipeline mixing bf16 text encoders with a float32 transformer, as the real FLUX.1-dev loads on
defaults, cannot run its denoiser; the README says to pass `torch_dtype` as for the real model, and
the last test runs the demo model's pipeline so.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIGS = sorted(p.stem for p in (REPO / "conf" / "model").glob("tiny_*.yaml"))


def _folder(config_name: str) -> Path:
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec

    spec = build_spec(compose_run([f"model={config_name}", "dataset=synthetic"]).model)
    spec.ensure_available()
    here = spec.path if spec.path.is_dir() else spec.path.parent
    return here if any((here / i).is_file() for i in INDEXES) else here.parent


# A pipeline folder's index: model_index.json, or a modular pipeline's (Anima's), whose entries
# are [library, class, {where to load it from}].
INDEXES = ("model_index.json", "modular_model_index.json")
# Libraries of model_index.json that no installed package provides: dpipe's module for them.
OWN_MODULES = {"omnigen2": "dpipe.models.omnigen2.transformer"}


def _stored_dtypes(directory: Path) -> set[torch.dtype]:
    """The dtypes of the floating-point tensors in a component's weight files."""
    out = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                out.add({"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(
                    dtype, dtype))
    return {d for d in out if isinstance(d, torch.dtype)}


@pytest.mark.parametrize("config_name", TINY_CONFIGS)
@pytest.mark.slow
def test_components_load_in_the_dtype_their_config_states(config_name):
    folder = _folder(config_name)
    index = json.loads(next(folder / i for i in INDEXES if (folder / i).is_file()).read_text())
    checked = 0
    for name, entry in index.items():
        # Components only: a pipeline's list-valued config (Krea 2's text_encoder_select_layers)
        # is no [library, class] pair.
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict):
            entry = entry[:2]  # a modular pipeline's component
        if name.startswith("_") or not isinstance(entry, list) or None in entry \
                or len(entry) != 2 or not all(isinstance(e, str) for e in entry):
            continue
        library, class_name = entry
        # A library that is no package is a diffusers pipeline's own module (LTX-2's "ltx2"),
        # or the reference repo's package of a model diffusers lacks, whose classes dpipe writes.
        module = library if library in ("diffusers", "transformers") else \
            OWN_MODULES.get(library, f"diffusers.pipelines.{library}")
        cls = getattr(importlib.import_module(module), class_name, None)
        if cls is None and library in OWN_MODULES:
            continue  # the reference package's non-model parts (OmniGen2's scheduler)
        if not issubclass(cls, torch.nn.Module):
            continue
        model = cls.from_pretrained(folder / name)  # what the pipeline does: no dtype given
        config = json.loads((folder / name / "config.json").read_text())
        stated = config.get("dtype") or config.get("torch_dtype")
        loaded = {p.dtype for p in model.parameters()}
        if library == "transformers":
            # transformers 5 loads in the stated dtype: it must be the weights' own.
            assert stated, f"{name}: config states no dtype"
            assert _stored_dtypes(folder / name) == {getattr(torch, stated)}, (name, stated)
            assert loaded == {getattr(torch, stated)}, (name, loaded)
            with torch.no_grad():  # and it computes in it
                ids = torch.tensor([[1, 2, 3, 4]])
                if model.get_input_embeddings() is not None and "Vision" not in class_name:
                    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
                    hidden = out[0]  # last hidden state, or logits
                    assert hidden.dtype == getattr(torch, stated) and hidden.isfinite().all()
        else:
            assert loaded == {torch.float32}, (name, loaded)  # diffusers' default
        checked += 1
    assert checked >= 2


def test_demo_model_pipeline_runs_with_the_dtype_given(tmp_path):
    """The demo's model in its pipeline, as the README loads it (`torch_dtype=torch.float32` on a
    CPU): one step end to end."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(_folder("tiny_flux"), torch_dtype=torch.float32)
    assert {p.dtype for c in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2, pipe.vae)
            for p in c.parameters()} == {torch.float32}
    image = pipe("a red circle", num_inference_steps=1, height=64, width=64,
                 output_type="pt").images
    assert image.shape == (1, 3, 64, 64) and image.isfinite().all()
