"""The checks every family's tiny model passes, run for each tiny model config
(`conf/model/tiny_*.yaml`) from what the family declares: its tiny folder is made once and is the
same everywhere, every denoiser parameter
sits in exactly one pipeline layer, and the LoRA reaches every block. The `test_tiny_<family>.py`
modules keep what is the family's own (loading in its pipeline, which for several families takes
arguments of their own; prompts, latents and layers against the pipeline's)."""

from __future__ import annotations

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from tests.unit.video_checks import tiny_spec

REPO = Path(__file__).resolve().parents[2]
# Every tiny model config: its family, the name its folder takes, and its values.
CONFIGS = {}
for _file in sorted((REPO / "conf/model").glob("tiny_*.yaml")):
    _values = yaml.safe_load(_file.read_text())
    CONFIGS[_file.stem] = (_values.pop("family"), _values.pop("path").rsplit("/", 1)[1],
                           {k: v for k, v in _values.items() if k != "defaults"})

# Denoiser parameters that no pipeline layer holds, by design: parts of the checkpoint a run of the
# tiny config never uses (so they stay frozen and out of the stages' memory).
NOT_IN_LAYERS = {
    # the sound stream and its cross-attention to video: in the layers with model.audio=true
    "tiny_ltx2": ("audio_", "av_cross_attn_"),
    "tiny_ltx23": ("audio_", "av_cross_attn_"),
    "tiny_omnigen2": ("ref_image_", "image_index_embedding"),  # edits: OmniGen2 trains text to image
}
# Blocks whose LoRA targets leave some out, by design: SDXL adapts the UNet's attention
# transformers, and its first down block and last up block have none.
PARTLY_ADAPTED = {"tiny_sdxl"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def _spec(models: Path, config: str):
    family, folder, values = CONFIGS[config]
    return tiny_spec(models / folder, family, **values)


def _files(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("config", CONFIGS)
def test_tiny_model_is_made_once_and_the_same_everywhere(config, models, tmp_path):
    """A second run finds the folder and leaves it alone; a folder made elsewhere holds the same
    bytes (cache keys hash these files: a tiny model that differed per machine would miss)."""
    spec = _spec(models, config)
    stamps = {p: p.stat().st_mtime_ns for p in spec.path.rglob("*")}
    spec.ensure_available()
    assert {p: p.stat().st_mtime_ns for p in spec.path.rglob("*")} == stamps
    again = _spec(tmp_path, config)
    assert _files(again.path) == _files(spec.path)


@pytest.mark.parametrize("config", CONFIGS)
def test_every_denoiser_parameter_is_in_exactly_one_pipeline_layer(config, models):
    spec = _spec(models, config)
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    assert spec.pipeline_layer_count() in (None, len(layers))
    held = Counter(n for layer in layers for n, _ in layer.source_named_parameters())
    assert {n for n, count in held.items() if count > 1} == set()
    unused = NOT_IN_LAYERS.get(config, ())
    expected = {n for n, _ in denoiser.named_parameters() if not n.startswith(unused)}
    assert set(held) == expected


@pytest.mark.parametrize("config", CONFIGS)
def test_lora_reaches_every_block(config, models):
    """The default targets put adapters in every block of the stages (a regex that missed one
    kind of block would train only the others, silently), and train nothing else. The blocks: the
    layers of the family's declared block types, else its most common layer type."""
    from tests.unit.video_checks import lora_denoiser

    spec = _spec(models, config)
    denoiser = lora_denoiser(spec)
    layers = spec.pipeline_layers(denoiser)
    kinds = getattr(spec, "block_types", ()) or \
        (Counter(type(layer) for layer in layers).most_common(1)[0][0],)
    blocks = [layer for layer in layers if isinstance(layer, kinds)]
    assert blocks
    adapted = [any("lora_" in n and p.requires_grad for n, p in layer.named_parameters())
               for layer in blocks]
    if config in PARTLY_ADAPTED:
        assert sum(adapted) >= len(blocks) / 2
    else:
        missing = [f"{i} ({type(b).__name__})" for i, (b, a) in enumerate(zip(blocks, adapted))
                   if not a]
        assert not missing, f"blocks without LoRA parameters: {missing}"
    trainable = {n for n, p in denoiser.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
