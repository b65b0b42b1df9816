"""Quantized single files (ComfyUI's scaled fp8, int8 with scales) read dequantized, on the tiny
FLUX model's weights in Black Forest Labs' layout with ComfyUI's prefix."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dpipe.config.schema import ModelConfig
from dpipe.errors import ModelLoadError
from dpipe.models.common.quantized_files import dequantized, file_is_quantized, write_quantized_copy
from dpipe.models.flux.tiny import make_tiny_flux, write_bfl_single_file
from dpipe.models.registry import build_spec

PREFIX = "model.diffusion_model."
E4M3, E5M2, INT8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
# Half a step of each format at the largest value it stores, relative to the tensor's largest
# weight (scale = amax / top): 8-bit storage cannot do better, and must not do worse.
#   e4m3: 3 mantissa bits -> |err| <= 2^-4 |w|, plus the subnormals' half step 2^-10 * scale;
#   e5m2: 2 mantissa bits -> 2^-3 |w|, plus 2^-17 * scale;  int8: uniform half step scale / 2.
FORMATS = {"e4m3": (E4M3, 2 ** -4, 2 ** -10 / 448), "e5m2": (E5M2, 2 ** -3, 2 ** -17 / 57344),
           "int8": (INT8, 0.0, 0.5 / 127)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny FLUX diffusers folder, its transformer as one plain BFL-layout file)."""
    root = tmp_path_factory.mktemp("quantized")
    folder = make_tiny_flux(root / "flux")
    return folder, write_bfl_single_file(folder, root / "flux1-dev.safetensors", PREFIX)


def _spec(path: Path, folder: Path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                          {"family": "flux", "path": str(path), "max_text_tokens": 16,
                           "single_file_config": str(folder)})
    return build_spec(OmegaConf.to_object(cfg))


def _assert_within_rounding(got: torch.Tensor, want: torch.Tensor, fmt: str, key: str):
    _, rel, step = FORMATS[fmt]
    want = want.to(torch.float32)  # the tiny model is bf16: bounds in bf16 would round
    bound = rel * want.abs() + step * want.abs().max() * 1.0001 + 1e-12
    err = (got - want).abs()
    assert (err <= bound).all(), f"{key}: error {(err - bound).max().item():.3g} above {fmt}'s"


@pytest.mark.parametrize("per_row", [False, True], ids=["per_tensor", "per_row"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantized_weights_are_the_originals_within_the_formats_rounding(tiny, tmp_path, fmt,
                                                                           per_row):
    _, plain = tiny
    file = write_quantized_copy(plain, tmp_path / "q.safetensors", FORMATS[fmt][0], per_row)
    stored = load_file(file)
    assert (f"{PREFIX}scaled_fp8" in stored) == (fmt != "int8")  # ComfyUI's marker: fp8 only
    assert stored[f"{PREFIX}double_blocks.0.img_attn.qkv.weight"].dtype == FORMATS[fmt][0]
    assert file_is_quantized(file) and not file_is_quantized(plain)
    want = load_file(plain)
    got = dequantized(dict(stored), file, torch.float32)
    assert got.keys() == want.keys()  # the marker and every scale_weight left out
    quantized = 0
    for key, value in want.items():
        if value.dim() == 2 and key.endswith(".weight"):
            _assert_within_rounding(got[key], value, fmt, key)
            quantized += not torch.equal(got[key], value)
        else:
            assert torch.equal(got[key], value), key  # biases, norms: as stored
    assert quantized > 10  # really stored in 8 bits


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_flux_trains_from_a_quantized_file_with_its_weights(tiny, tmp_path, fmt):
    """Through the family's BFL key map (qkv split, modulation swap): the denoiser equals the
    folder's within the format's rounding, per tensor as ComfyUI writes fp8_scaled files."""
    folder, plain = tiny
    file = write_quantized_copy(plain, tmp_path / "flux1-dev-q.safetensors", FORMATS[fmt][0])
    spec = _spec(file, folder)
    spec.ensure_available()
    # Each stage reads its own weights with their scales (test_stage_loading.py), as a plain
    # file's stages do.
    assert spec.loads_stage_weights and _spec(plain, folder).loads_stage_weights
    got = spec.load_denoiser(torch.float32).state_dict()
    want = _spec(plain, folder).load_denoiser(torch.float32).state_dict()
    assert got.keys() == want.keys()
    rel, step = FORMATS[fmt][1], FORMATS[fmt][2]
    for key, value in want.items():
        # A split keeps the fused tensor's scale: bound by the fused tensor's largest weight,
        # which is at most the largest weight of the model.
        top = max(v.abs().max() for v in want.values())
        assert ((got[key] - value).abs() <= rel * value.abs() + step * top * 1.0001).all(), key
    assert not all(torch.equal(got[k], want[k]) for k in want)
    # A LoRA's load keeps the file's bytes beside those values (dpipe.train.stored_base): the
    # qkv split in three, each part with the fused tensor's scale.
    modules = dict(spec.load_denoiser(torch.float32).named_modules())
    stored = load_file(file)
    parts = [vars(modules[f"transformer_blocks.0.attn.{p}"])["stored_form"]
             for p in ("to_q", "to_k", "to_v")]
    assert all(p.values.dtype == FORMATS[fmt][0] and p.group == 0 for p in parts)
    assert torch.equal(torch.cat([p.values for p in parts]).view(torch.uint8),
                       stored[f"{PREFIX}double_blocks.0.img_attn.qkv.weight"].view(torch.uint8))
    scale = stored[f"{PREFIX}double_blocks.0.img_attn.qkv.scale_weight"]
    assert all(torch.equal(p.scale, scale.expand(p.scale.shape)) for p in parts)


def _rescaled(file: Path, out: Path, weight_factor: float, scale_factor: float) -> Path:
    state = load_file(file)
    for key in [k for k in state if k.endswith(".scale_weight")]:
        weight = key.removesuffix(".scale_weight") + ".weight"
        w = state[weight]
        state[weight] = (w.to(torch.float32) * weight_factor).to(w.dtype)
        state[key] = state[key] * scale_factor
    save_file(state, str(out))
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_scales_are_used(tiny, tmp_path, fmt):
    _, plain = tiny
    file = write_quantized_copy(plain, tmp_path / "q.safetensors", FORMATS[fmt][0])
    base = dequantized(load_file(file), file, torch.float32)
    doubled = _rescaled(file, tmp_path / "x2.safetensors", 1.0, 2.0)
    twice = dequantized(load_file(doubled), doubled, torch.float32)
    scaled = [k for k in base if k.endswith(".weight") and base[k].dim() == 2]
    assert scaled and all(torch.equal(twice[k], 2 * base[k]) for k in scaled)
    if fmt != "int8":
        # Halving an fp8 value is exact (one exponent step) but for the subnormals, which lose
        # their last bit: the same weights, the smallest within one subnormal step.
        halved = _rescaled(file, tmp_path / "half.safetensors", 0.5, 2.0)
        same = dequantized(load_file(halved), halved, torch.float32)
        scales = load_file(file)
        tiny_step = torch.finfo(FORMATS[fmt][0]).smallest_normal / 8 if fmt == "e4m3" else (
            torch.finfo(FORMATS[fmt][0]).smallest_normal / 4)
        for k in scaled:
            step = scales[k.removesuffix('.weight') + '.scale_weight'] * tiny_step
            assert ((same[k] - base[k]).abs() <= step * 1.0001).all(), k
            assert (same[k] == base[k]).float().mean() > 0.9, k
        assert all(torch.equal(same[k], base[k]) for k in base if k not in scaled)


def _with(file: Path, out: Path, **extra: torch.Tensor) -> Path:
    state = load_file(file)
    state.update(extra)
    save_file(state, str(out))
    return out


def test_an_unknown_quantization_layout_is_refused_naming_its_keys(tiny, tmp_path):
    folder, plain = tiny
    file = write_quantized_copy(plain, tmp_path / "q.safetensors", E4M3)
    key = f"{PREFIX}double_blocks.0.img_attn.qkv.weight_scale"
    odd = _with(file, tmp_path / "odd.safetensors", **{key: torch.ones(())})
    with pytest.raises(ModelLoadError, match=rf"odd.safetensors.*{key}.*scale_weight"):
        _spec(odd, folder).load_denoiser(torch.float32)
    bnb = _with(plain, tmp_path / "bnb.safetensors",
                **{f"{PREFIX}img_in.weight.absmax": torch.ones(4)})
    with pytest.raises(ModelLoadError, match="layout dpipe does not read.*absmax"):
        _spec(bnb, folder).load_denoiser(torch.float32)


def test_a_marker_of_another_format_and_int8_without_scales_are_refused(tiny, tmp_path):
    folder, plain = tiny
    marker = _with(plain, tmp_path / "m.safetensors",
                   **{f"{PREFIX}scaled_fp8": torch.empty(0, dtype=torch.bfloat16)})
    with pytest.raises(ModelLoadError, match=r"scaled_fp8 has dtype torch.bfloat16"):
        _spec(marker, folder).load_denoiser(torch.float32)
    state = load_file(plain)
    state[f"{PREFIX}img_in.weight"] = state[f"{PREFIX}img_in.weight"].to(INT8)
    save_file(state, str(tmp_path / "i8.safetensors"))
    with pytest.raises(ModelLoadError, match=r"int8 weights without.*img_in.weight"):
        _spec(tmp_path / "i8.safetensors", folder).load_denoiser(torch.float32)
    file = write_quantized_copy(plain, tmp_path / "q.safetensors", E4M3, per_row=False)
    state = load_file(file)
    state[f"{PREFIX}img_in.scale_weight"] = torch.ones(3)  # neither one nor one per row
    save_file(state, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ModelLoadError, match=r"scale of .*img_in.weight has shape \(3,\)"):
        _spec(tmp_path / "shape.safetensors", folder).load_denoiser(torch.float32)


def test_input_scales_are_read_and_left_unused(tiny, tmp_path):
    """scale_input quantizes an fp8 matmul's input; dpipe's matmuls take bf16/fp32 inputs."""
    folder, plain = tiny
    file = write_quantized_copy(plain, tmp_path / "q.safetensors", E4M3)
    with_input = _with(file, tmp_path / "in.safetensors",
                       **{f"{PREFIX}double_blocks.0.img_attn.qkv.scale_input": torch.ones(())})
    a = _spec(file, folder).load_denoiser(torch.float32).state_dict()
    b = _spec(with_input, folder).load_denoiser(torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_full_export_of_a_quantized_source_is_a_plain_bf16_file(tiny, tmp_path):
    """The source's scales were fitted to the base weights: the trained weights go out in bf16."""
    from dpipe.models.common.bfl_layout import source_format

    _, plain = tiny
    file = write_quantized_copy(plain, tmp_path / "q.safetensors", E4M3)
    assert source_format(file) == (PREFIX, torch.bfloat16)
