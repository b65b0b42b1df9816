"""Adapters besides LoRA (model.adapter=dora|lokr|loha), model.lora.init_from and
model.merge_adapters, on real peft layers and the tiny FLUX model, in this process."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest
import torch
from peft import inject_adapter_in_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from dpipe.config.compose import compose_run
from dpipe.config.schema import Adapter
from dpipe.errors import ConfigError
from dpipe.models.adapters import (
    adapter_metadata, is_adapter_param, load_adapter_file, lycoris_delta, lycoris_tensors,
    peft_config)
from dpipe.models.lora_files import DIFFUSERS_LORA, peft_to_diffusers
from dpipe.models.registry import build_spec
from dpipe.train.trainable import trainable_layers
from tests.exports import export_lora

BASE = ["model=tiny_flux", "dataset=synthetic", "dataset.path=/unused", "model.lora.alpha=2"]
ADAPTERS = ["lora", "dora", "lokr", "loha"]


def _cfg(adapter: str, rank: int, alpha: float, factor: int = -1):
    from types import SimpleNamespace

    return SimpleNamespace(adapter=Adapter(adapter), lokr_factor=factor,
                           lora=SimpleNamespace(rank=rank, alpha=alpha, targets=None))


def _randomized(module: nn.Module, seed: int = 0) -> None:
    """Trained-looking adapter weights: peft starts some at zero, which would hide a wrong
    scale or a swapped factor."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if is_adapter_param(name):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 48), nn.Linear(16, 32)])


@pytest.mark.parametrize("adapter, rank", [("lokr", 2), ("lokr", 8), ("loha", 4)])
def test_the_lycoris_file_gives_each_module_the_delta_peft_computes(adapter, rank):
    """LoKr at rank 2 decomposes its second factor (the loaders scale by alpha / rank), at rank
    8 keeps both factors full (the loaders apply scale 1, so the file folds alpha / r in)."""
    model = Two()
    metadata = adapter_metadata(_cfg(adapter, rank, alpha=3.0), ["blocks.0", "blocks.1"])
    inject_adapter_in_model(peft_config(Adapter(adapter), metadata), model, adapter_name="default")
    _randomized(model)
    weights = peft_to_diffusers({n: p.detach() for n, p in model.named_parameters()
                                 if is_adapter_param(n)})
    tensors = lycoris_tensors(weights, metadata)
    prefix = "lycoris_blocks_0."
    assert any(k.startswith(prefix) for k in tensors)
    parts = {k.removeprefix(prefix) for k in tensors if k.startswith(prefix)}
    if adapter == "loha":
        assert parts == {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}
    elif rank == 2:
        assert {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"} <= parts
    else:
        assert parts == {"lokr_w1", "lokr_w2"}  # full factors: no rank, no alpha
    for i, linear in enumerate(model.blocks):
        expected = linear.get_delta_weight("default")
        got = lycoris_delta(tensors, f"blocks.{i}", linear.get_base_layer().weight.shape)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_adapter_parameters_are_recognised_by_their_peft_names():
    for name in ["a.to_q.lora_A.default.weight", "a.to_q.lora_magnitude_vector.default.weight",
                 "a.to_q.lokr_w1.default", "a.to_q.lokr_w2_b.default", "a.to_q.hada_w1_a.default"]:
        assert is_adapter_param(name), name
    assert not is_adapter_param("a.to_q.base_layer.weight")
    assert not is_adapter_param("x_lora_like.weight")


def test_metadata_is_the_peft_config_diffusers_reads():
    assert adapter_metadata(_cfg("dora", 4, 2.0), "t") == {
        "r": 4, "lora_alpha": 2.0, "target_modules": "t", "use_dora": True}
    assert adapter_metadata(_cfg("lokr", 4, None, factor=8), "t") == {
        "r": 4, "alpha": 4, "target_modules": "t", "decompose_factor": 8}
    assert adapter_metadata(_cfg("loha", 4, None), "t") == {
        "r": 4, "alpha": 4, "target_modules": "t"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Per adapter: the tiny model's spec, its adapted layers with trained-looking weights, and
    their export."""
    out = {}
    for adapter in ADAPTERS:
        run = compose_run([*BASE, f"model.adapter={adapter}"])
        spec = build_spec(run.model)
        spec.ensure_available()
        layers = trainable_layers(spec, run)
        for layer in layers:
            _randomized(layer)
        state = {}
        for layer in layers:
            state.update(layer.denoiser_state_dict(trainable_only=True))
        folder = tmp_path_factory.mktemp(adapter)
        export_lora(spec, {k: v.detach() for k, v in state.items()}, folder)
        out[adapter] = spec, layers, state, folder
    return out


def _inputs(spec):
    from dpipe.bench.worker import fixed_micro_batches

    (inputs, _labels), = fixed_micro_batches(spec, "tiny", 1, 2, seed=0)
    return inputs


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_the_export_loaded_as_documented_reproduces_the_adapted_model(adapter, exports):
    """lora and dora: FluxPipeline.load_lora_weights; lokr: transformer.load_lora_adapter
    (FluxPipeline's load_lora_weights takes LoRA keys only); loha: peft, through
    dpipe.models.adapters.load_adapter_file."""
    from diffusers import FluxPipeline

    from tests.integration.trained import run_layers

    spec, layers, _, folder = exports[adapter]
    pipe = FluxPipeline.from_pretrained(spec.path, text_encoder=None, text_encoder_2=None,
                                        vae=None, tokenizer=None, tokenizer_2=None,
                                        transformer=spec.load_denoiser(torch.float32))
    if adapter in ("lora", "dora"):
        pipe.load_lora_weights(str(folder))
    elif adapter == "lokr":
        pipe.transformer.load_lora_adapter(str(folder), weight_name=DIFFUSERS_LORA,
                                           prefix="transformer")
    else:
        load_adapter_file(pipe.transformer, folder / DIFFUSERS_LORA)
    inputs = _inputs(spec)
    with torch.no_grad():
        got = spec.denoiser_forward(pipe.transformer, inputs)
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
    trained = run_layers(layers, inputs)
    assert (trained - base).abs().max() > 1e-3, "the adapter has no effect to reproduce"
    torch.testing.assert_close(got, trained, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_exports_json_records_what_each_format_holds(adapter, exports):
    folder = exports[adapter][3]
    record = json.loads((folder / "exports.json").read_text())["formats"]
    comfy = record["flux_lora_comfyui.safetensors"]
    assert record[DIFFUSERS_LORA]["written"]
    if adapter == "lora":
        assert comfy["written"]
        return
    if adapter == "dora":
        assert not comfy["written"] and not (folder / "flux_lora_comfyui.safetensors").exists()
        assert "DoRA" in comfy["error"]
    if adapter in ("lokr", "loha"):
        # The ComfyUI file: each module that BFL's checkpoint keeps whole, under its name there,
        # with the delta of the LyCORIS file; the ones it fuses (to_q, to_k, to_v) left out.
        assert comfy["written"] and "transformer_blocks.0.attn.to_q" in comfy["left_out"]
        held = load_file(folder / "flux_lora_comfyui.safetensors")
        lycoris = load_file(folder / f"lycoris_{adapter}.safetensors")
        shape = (32, 32)
        torch.testing.assert_close(
            lycoris_delta(held, "", shape, name="diffusion_model.double_blocks.0.img_attn.proj"),
            lycoris_delta(lycoris, "transformer_blocks.0.attn.to_out.0", shape))
        assert record[f"lycoris_{adapter}.safetensors"]["written"]
        tensors = load_file(folder / f"lycoris_{adapter}.safetensors")
        assert all(k.startswith("lycoris_") for k in tensors)
        assert any(k.startswith("lycoris_transformer_blocks_0_attn_to_q.") for k in tensors)
        with safe_open(str(folder / DIFFUSERS_LORA), "pt") as f:
            meta = json.loads(f.metadata()["lora_adapter_metadata"])
        assert meta["transformer.r"] == 4 and meta["transformer.alpha"] == 2


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_init_from_an_export_starts_from_its_weights(adapter, exports):
    """From the diffusers file exactly; from the LyCORIS file of a LoKr or LoHa too (a full
    LoKr's scale, folded into lokr_w2 there, taken out again)."""
    spec, _, state, folder = exports[adapter]
    files = [folder] + ([folder / f"lycoris_{adapter}.safetensors"]
                        if adapter in ("lokr", "loha") else [])
    for file in files:
        run = compose_run([*BASE, f"model.adapter={adapter}", f"model.lora.init_from={file}"])
        again = {}
        for layer in trainable_layers(spec, run):
            again.update(layer.denoiser_state_dict(trainable_only=True))
        assert sorted(again) == sorted(state)
        for key in state:
            if file == folder:
                assert torch.equal(again[key], state[key].float()), key
            else:
                torch.testing.assert_close(again[key], state[key].float(), msg=key)


def test_init_from_refuses_a_file_of_another_rank_naming_the_module(exports, tmp_path):
    """A file without the adapter config (another tool's): its shapes are checked."""
    spec, _, _, _ = exports["lora"]
    run = compose_run([*BASE, "model.lora.rank=8"])
    layers = trainable_layers(spec, run)
    state = {}
    for layer in layers:
        state.update(layer.denoiser_state_dict(trainable_only=True))
    file = tmp_path / "rank8.safetensors"
    save_file({f"transformer.{k}": v.contiguous() for k, v in peft_to_diffusers(state).items()},
              file)
    run = compose_run([*BASE, f"model.lora.init_from={file}"])  # rank 4
    with pytest.raises(ConfigError) as err:
        trainable_layers(spec, run)
    said = str(err.value)
    assert f"model.lora.init_from={file}: module " in said
    assert "expected shape (4, " in said and "found shape (8, " in said, said


def test_init_from_refuses_another_adapter_and_unknown_layouts(exports, tmp_path):
    from dpipe.launch.prestart import check_before_workers

    spec, _, _, folder = exports["lokr"]
    run = compose_run([*BASE, f"model.lora.init_from={folder}"])
    with pytest.raises(ConfigError, match="holds a lokr adapter, but this run trains "
                                          "model.adapter=lora: set model.adapter=lokr"):
        check_before_workers(run, tmp_path, spec)
    other = tmp_path / "other.safetensors"
    save_file({"blocks.0.attn.weight": torch.zeros(2, 2), "blocks.0.lora_A.weight":
               torch.zeros(1, 2)}, other)
    run = compose_run([*BASE, f"model.lora.init_from={other}"])
    with pytest.raises(ConfigError, match=f"init_from={other}: keys of no LoRA layout dpipe "
                                          r"reads: blocks.0.attn.weight \(1 of 2\); dpipe reads "
                                          "diffusers, peft, ComfyUI, ai-toolkit/musubi-tuner, "
                                          "kohya, LyCORIS LoCon/LoKr/LoHa/DoRA files"):
        check_before_workers(run, tmp_path, spec)


@pytest.mark.parametrize("adapter", ["lora", "loha"])
def test_merge_adapters_adds_each_module_s_delta_to_the_base(adapter, exports):
    """Each adapted Linear's merged weight is its base weight plus the delta peft computes for
    the file's adapter (for a LoRA also scale * B @ A from the file by hand), the other weights
    are the base's, and the run trains a fresh LoRA over the merged base."""
    from dpipe.train.adapter_init import merge_adapters

    spec, _, _, folder = exports[adapter]
    base = spec.load_denoiser(torch.float32)
    merged = spec.load_denoiser(torch.float32)
    merge_adapters(merged, [str(folder)], spec)
    assert not any(is_adapter_param(n) for n, _ in merged.named_parameters())
    reference = spec.load_denoiser(torch.float32)
    load_adapter_file(reference, folder / DIFFUSERS_LORA)
    adapted = {name: module for name, module in reference.named_modules()
               if hasattr(module, "get_delta_weight")}
    assert adapted
    merged_state, base_state = merged.state_dict(), base.state_dict()
    for name, module in adapted.items():
        expected = base_state[f"{name}.weight"] + module.get_delta_weight("default")
        torch.testing.assert_close(merged_state[f"{name}.weight"], expected)
    untouched = set(base_state) - {f"{name}.weight" for name in adapted}
    for key in untouched:
        assert torch.equal(merged_state[key], base_state[key]), key
    if adapter == "lora":
        file = load_file(folder / DIFFUSERS_LORA)
        module = "transformer_blocks.0.attn.to_q"
        a, b = (file[f"transformer.{module}.lora_{x}.weight"] for x in "AB")
        torch.testing.assert_close(merged_state[f"{module}.weight"],
                                   base_state[f"{module}.weight"] + (2 / 4) * b @ a)

    run = compose_run([*BASE, f"model.merge_adapters=[{folder}]"])
    layers = trainable_layers(spec, run)
    state = {}
    for layer in layers:
        state.update(layer.denoiser_state_dict(trainable_only=False))
    torch.testing.assert_close(state["transformer_blocks.0.attn.to_q.base_layer.weight"],
                               merged_state["transformer_blocks.0.attn.to_q.weight"])
    assert any("lora_A" in k for k in state)


@pytest.mark.parametrize("overrides, said", [
    (["model.mode=full", "model.adapter=lokr"], "model.adapter=lokr adds an adapter, but "
                                                "model.mode=full"),
    (["model.adapter=dora", "model.base_dtype=fp8", "train.precision=bf16"],
     "drop model.base_dtype with DoRA"),
    (["model.adapter=dora", "model.base_compute=fp8", "train.precision=bf16"],
     "drop model.base_compute with DoRA"),
    (["model.lokr_factor=8"], "model.lokr_factor=8 applies to model.adapter=lokr"),
    (["model.adapter=lokr", "model.lokr_factor=0"], "model.lokr_factor must be -1"),
    (["model.mode=full", "model.lora.init_from=/x.safetensors"],
     "model.mode=full trains no adapter"),
])
def test_combinations_that_cannot_train_are_refused_before_any_worker(overrides, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        compose_run([*BASE, *overrides])


@pytest.mark.parametrize("adapter", ["lokr", "loha"])
def test_lokr_and_loha_train_over_fp8_base_weights(adapter):
    """peft's LoKr and LoHa read only the base weight's shape, so fp8 base layers (stored scaled
    per row) serve them as they serve LoRA: the output is bf16's within fp8's rounding, and a
    step moves only the adapter."""
    from dpipe.train.fp8 import QuantizedLinear

    outputs = {}
    for base_dtype in ("auto", "fp8"):
        run = compose_run([*BASE, f"model.adapter={adapter}", "train.precision=bf16",
                           f"model.base_dtype={base_dtype}"])
        spec = build_spec(run.model)
        spec.ensure_available()
        layers = trainable_layers(spec, run)
        for layer in layers:
            _randomized(layer)
        inputs = _inputs(spec)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = inputs
            for layer in layers:
                x = layer(x)
        outputs[base_dtype] = x.float()
    assert any(isinstance(m, QuantizedLinear) for layer in layers for m in layer.modules())
    x.float().pow(2).mean().backward()
    grads = [p.grad for layer in layers for p in layer.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    diff = (outputs["fp8"] - outputs["auto"]).abs().max() / outputs["auto"].abs().max()
    assert diff < 0.03, diff
