"""Single-file transformers of the image families SD3 / SD3.5, Chroma, HiDream-I1, AuraFlow and
HunyuanImage 2.1 in the layout users download: each tiny transformer written under its original
names (the inverse of diffusers' converter, which does the reading; HunyuanImage's has no
converter in diffusers, see hunyuan_image/original.py), loaded through the spec with
model.single_file_config naming the diffusers folder, gives exactly the folder's weights (with
and without ComfyUI's `model.diffusion_model.` prefix); another family's file fails naming the
file; a full fine-tune is written back in the file's layout too."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from dpipe.config.schema import ModelConfig
from dpipe.errors import ConfigError, ModelLoadError
from dpipe.models.registry import build_spec
from tests.unit.video_checks import assert_same_tensors
from tests.exports import export_lora

# family -> (file name as released, a key of the original layout, diffusers' model type of the
# file or None where diffusers detects it by the real sizes only)
FAMILIES = {
    "sd3": ("sd3.5_medium.safetensors", "joint_blocks.0.x_block.attn.qkv.weight", None),
    "auraflow": ("aura_flow_0.3.safetensors", "double_layers.0.attn.w2q.weight", "auraflow"),
    "chroma": ("Chroma1-HD.safetensors", "single_blocks.0.linear1.weight", "chroma"),
    "hidream": ("hidream_i1_full_fp16.safetensors",
                "double_stream_blocks.0.block.adaLN_modulation.1.bias", "hidream"),
    # Tencent's layout (hunyuan_image/original.py); diffusers 0.42.1 does not detect this family
    "hunyuan_image": ("hunyuanimage2.1_bf16.safetensors", "double_blocks.0.img_attn_qkv.weight",
                      None),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("models"), {}

    def get(family: str) -> Path:
        if family not in made:
            tiny = importlib.import_module(f"dpipe.models.{family}.tiny")
            made[family] = getattr(tiny, f"make_tiny_{family}")(root / family)
        return made[family]
    return get


def _write(folders, family: str, directory: Path, prefix: str = "") -> Path:
    tiny = importlib.import_module(f"dpipe.models.{family}.tiny")
    return tiny.write_single_file(folders(family), directory / FAMILIES[family][0], prefix=prefix)


def _spec(family: str, path: Path, **values):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": family, "path": str(path), "max_text_tokens": 16, **values}))
    return build_spec(cfg)


def _keys(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(file, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_tiny_file_is_in_the_original_layout(folders, tmp_path, family):
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    _, marker, kind = FAMILIES[family]
    keys = _keys(_write(folders, family, tmp_path, "model.diffusion_model."))
    assert f"model.diffusion_model.{marker}" in keys
    assert all(k.startswith("model.diffusion_model.") for k in keys)
    assert len({v.dtype for v in keys.values()}) == 1  # as the tiny folder stores it
    if kind is not None:  # diffusers' own detection (which some families do without the prefix)
        plain = {k.removeprefix("model.diffusion_model."): v for k, v in keys.items()}
        assert infer_diffusers_model_type(plain) == kind


def _labelled(shape) -> torch.Tensor:
    """A tensor whose every row holds its row index, stored as one column (no memory for the real
    widths): splits and concatenations along dim 0 show in the values."""
    rows = torch.arange(shape[0], dtype=torch.int32)
    return rows.view(-1, *([1] * (len(shape) - 1))).expand(*shape)


def test_chroma_split_agrees_with_diffusers_converter_at_real_sizes():
    """diffusers' Chroma converter splits the single blocks' linear1 at Chroma's width (3072),
    so dpipe splits at the model's own sizes; at the real sizes both give the same weights for
    every key (one block of each kind, rows labelled), and the original names written for the
    tiny files are the ones diffusers reads."""
    from diffusers import ChromaTransformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_chroma_transformer_checkpoint_to_diffusers)

    from dpipe.models.chroma.original import from_original, original_state_dict

    with torch.device("meta"):  # Chroma1-HD's config (diffusers' defaults), one block per kind
        model = ChromaTransformer2DModel(num_layers=1, num_single_layers=1)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    native = {k: _labelled(v.shape) for k, v in original_state_dict(
        {k: torch.empty(s, device="meta") for k, s in shapes.items()}).items()}
    assert native["single_blocks.0.linear1.weight"].shape == (3 * 3072 + 12288, 3072)
    theirs = convert_chroma_transformer_checkpoint_to_diffusers(dict(native))
    ours = from_original(native, model)
    assert ours.keys() == theirs.keys() == shapes.keys()
    for key in theirs:
        assert ours[key].shape == shapes[key] and torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_loads_as_the_folder(folders, tmp_path, family, prefix):
    folder = folders(family)
    file = _write(folders, family, tmp_path, prefix)
    spec = _spec(family, file, single_file_config=str(folder))
    spec.ensure_available()
    assert spec.path == folder and spec.single_file == file
    want = _spec(family, folder).load_denoiser(torch.float32).state_dict()
    got = spec.load_denoiser(torch.float32).state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], value), key
    if not prefix:  # at bf16, every parameter and buffer as from_pretrained loads the folder's
        assert_same_tensors(spec.load_denoiser(torch.bfloat16),
                            _spec(family, folder).load_denoiser(torch.bfloat16))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_its_gguf_is_read_kept_quantized(folders, tmp_path, family):
    from tests.unit.test_gguf_files import assert_gguf_keeps_the_values

    folder = folders(family)
    assert_gguf_keeps_the_values(
        lambda path: _spec(family, path, single_file_config=str(folder)),
        _write(folders, family, tmp_path, "model.diffusion_model."), tmp_path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_file_of_another_family_fails_naming_it(folders, tmp_path, family):
    others = [f for f in FAMILIES if f != family]
    files = [_write(folders, f, tmp_path) for f in others[:1]]
    junk = tmp_path / "not_a_model.safetensors"
    save_file({"blocks.0.ffn.0.weight": torch.zeros(4, 4)}, junk)
    for file in [*files, junk]:
        spec = _spec(family, file, single_file_config=str(folders(family)))
        spec.ensure_available()
        with pytest.raises(ModelLoadError, match=re.escape(str(file))):
            spec.load_denoiser(torch.float32)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_single_file_config_errors(folders, tmp_path, family):
    file = _write(folders, family, tmp_path)
    with pytest.raises(ConfigError, match="single_file_config"):
        _spec(family, file)  # a file alone: where do the VAE and text encoders come from?
    with pytest.raises(ConfigError, match="single_file_config is only used"):
        _spec(family, folders(family), single_file_config=str(folders(family)))
    missing = _spec(family, tmp_path / "missing.safetensors",
                    single_file_config=str(folders(family)))
    with pytest.raises(ModelLoadError, match="missing.safetensors does not exist"):
        missing.ensure_available()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_export_of_a_single_file_model_writes_that_layout_too(folders, tmp_path, family):
    """The fine-tune is written as the diffusers folder and as a file named, keyed and typed as
    the source, which loads back as the trained weights."""
    file = _write(folders, family, tmp_path, "model.diffusion_model.")
    spec = _spec(family, file, single_file_config=str(folders(family)), mode="full")
    spec.ensure_available()
    denoiser = spec.load_denoiser(torch.float32)
    with torch.no_grad():
        for param in denoiser.parameters():
            param.add_(0.01 * torch.randn_like(param))  # "trained"
    shard = tmp_path / "stage-0.safetensors"
    save_file({k: v.contiguous() for k, v in denoiser.state_dict().items()}, shard)
    out = tmp_path / "model"
    spec.export_full([shard], out)

    source, got = _keys(file), _keys(out / file.name)
    assert list(got) == list(source)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in source.items()}
    reloaded = _spec(family, out / file.name, single_file_config=str(folders(family)))
    back = reloaded.load_denoiser(torch.float32).state_dict()
    base = _spec(family, folders(family)).load_denoiser(torch.float32).state_dict()
    stored = next(iter(source.values())).dtype
    for name, value in denoiser.state_dict().items():
        assert torch.equal(back[name], value.to(stored).float()), name
    assert sum(not torch.equal(back[k], base[k]) for k in base) >= len(base) // 2
    folder = spec.load_exported_full(out).state_dict()
    for name, value in denoiser.state_dict().items():
        torch.testing.assert_close(folder[name], value)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_exported_lora_loads_onto_the_single_file_transformer(folders, tmp_path, family):
    """`load_denoiser_with_lora` (the diffusers way of loading the LoRA) puts it on the single
    file's transformer, not the folder's: with someone's fine-tune as the file, the LoRA sits on
    the fine-tuned weights."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    source = _write(folders, family, tmp_path)
    generator = torch.Generator().manual_seed(0)
    file = tmp_path / "fine-tune" / source.name
    file.parent.mkdir()
    save_file({k: (v.float() + 0.05 * torch.randn(v.shape, generator=generator)).to(v.dtype)
               for k, v in _keys(source).items()}, file)
    spec = _spec(family, file, single_file_config=str(folders(family)), lora={"rank": 2})
    spec.ensure_available()
    denoiser = spec.load_denoiser(torch.float32)
    tuned = {k: v.clone() for k, v in denoiser.state_dict().items()}
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=spec.lora_targets(),
                                       init_lora_weights=False), denoiser)
    out = tmp_path / "lora"
    out.mkdir()
    export_lora(spec, get_peft_model_state_dict(denoiser, adapter_name="default"), out)
    loaded = spec.load_denoiser_with_lora(out).state_dict()
    assert any("lora_" in k for k in loaded)
    base = {k.replace(".base_layer", ""): v for k, v in loaded.items() if "lora_" not in k}
    assert base.keys() == tuned.keys()
    for key, value in tuned.items():
        assert torch.equal(base[key].float(), value), key
