"""`dpipe-lora merge` into the quantized file a LoRA was trained on, as docs/lora-files.md shows
it: a ComfyUI 8-bit file (comfy_quant float8_e4m3fn, float8_e5m2, int8_tensorwise and int8
convrot layers, as `test_comfy_quant` writes them) and a GGUF Q8_0 file (the `gguf` package's
writer), each of the tiny FLUX model. The merged file is the one ComfyUI's rule makes, written
here from its source (ComfyUI 0.33.0, upstream 783545f6: `comfy/model_patcher.py`
`patch_weight_to_device` dequantizes, adds alpha / rank * up @ down in fp32 and calls the
layer's `set_weight`, `requantize_from_float(scale="recalculate")`; comfy-kitchen 0.2.31's
quantizers: float8 amax / the format's max per tensor, int8 amax / 127 per tensor, or per row
after the Hadamard rotation for convrot), rounded to nearest as ComfyUI's file quantizers round;
a GGUF tensor requantized by the `gguf` package's quantizer in its own type. Loaded back, the
merged file is dpipe's trained model within the format's rounding."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dpipe.cli.lora import main
from dpipe.config.compose import compose_run
from dpipe.models.common.gguf_files import with_plain_linears, write_gguf_copy
from dpipe.models.flux.tiny import write_bfl_single_file
from dpipe.models.registry import build_spec
from tests.exports import adapted, adapter_state, export_lora
from tests.unit.test_comfy_quant import DTYPES, FORMATS, PREFIX, by_groups, comfy_quant_copy

EIGHT_BIT = {part: fmt for part, fmt in FORMATS.items() if fmt[0] in DTYPES}


def comfyui_merged(file, lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The comfy_quant `file` with the ComfyUI LoRA `lora` merged by ComfyUI's rule."""
    state = load_file(file)
    for key in [k for k in lora if k.endswith(".lora_A.weight")]:
        module = key.removeprefix("diffusion_model.").removesuffix(".lora_A.weight")
        down, up = lora[key].double(), lora[key.replace("lora_A", "lora_B")].double()
        alpha = lora.get(f"diffusion_model.{module}.alpha", torch.tensor(float(len(down))))
        layer = PREFIX + module
        conf = json.loads(bytes(state[f"{layer}.comfy_quant"].tolist()))
        group = conf.get("convrot_groupsize", 0) if conf.get("convrot") else 0
        w = state[f"{layer}.weight"].double() * state[f"{layer}.weight_scale"].double()
        w = (by_groups(w, group) if group else w) + float(alpha) / len(down) * up @ down
        if group:  # the convrot quantizer: rotate, then one scale per row
            w = by_groups(w, group)
        amax = w.abs().amax(1, keepdim=True) if group else w.abs().amax()
        dtype = DTYPES[conf["format"]]
        if dtype == torch.int8:
            scale = (amax.float() / 127.0).clamp(min=1e-30)
            q = (w.float() * (1.0 / scale)).round().clamp(-128, 127)
        else:
            scale = amax.float() / torch.finfo(dtype).max
            q = w.float() / scale
        state[f"{layer}.weight"], state[f"{layer}.weight_scale"] = q.to(dtype), scale
    return state


def gguf_merged(file, lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GGUF `file`'s tensors, each a LoRA touches dequantized, the delta added and
    requantized in its own type by the `gguf` package; {name: fp32 values}."""
    import gguf

    out = {}
    for tensor in gguf.GGUFReader(str(file)).tensors:
        w = torch.tensor(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        down = lora.get(f"diffusion_model.{tensor.name.removesuffix('.weight')}.lora_A.weight")
        if down is not None:
            up = lora[f"diffusion_model.{tensor.name.removesuffix('.weight')}.lora_B.weight"]
            w = w + up.float() @ down.float()  # the export folds alpha / rank into up
            w = torch.tensor(gguf.quants.dequantize(
                gguf.quants.quantize(w.numpy(), tensor.tensor_type), tensor.tensor_type))
        out[tensor.name] = w
    return out


def gguf_values(file) -> dict[str, torch.Tensor]:
    import gguf

    return {t.name: torch.tensor(gguf.quants.dequantize(t.data, t.tensor_type))
            for t in gguf.GGUFReader(str(file)).tensors}


def _inputs(spec):
    """The denoiser's inputs for one random noised sample."""
    from dpipe.models.spec import NoisedBatch

    torch.manual_seed(0)
    latent, text = spec.random_sample("tiny")
    latents, text = latent[None], {k: v[None] for k, v in text.items()}
    noise, t = torch.randn(latents.shape), torch.full((1,), 0.6)
    noisy, target = spec.noise(latents, noise, t)
    return spec.make_inputs(NoisedBatch(latents=latents, noise=noise, timesteps=t, noisy=noisy,
                                        target=target, text=text))[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny FLUX model's BFL-layout single file, a LoRA run's model config on such a file
    with the diffusers folder for the rest)."""
    import dataclasses

    run = compose_run(["model=tiny_flux", "dataset=synthetic", "dataset.path=/unused",
                       "model.lora.alpha=2"])
    spec = build_spec(run.model)
    spec.ensure_available()
    plain = write_bfl_single_file(spec.path, tmp_path_factory.mktemp("merge") / "flux1-dev."
                                  "safetensors", PREFIX)
    return plain, dataclasses.replace(run.model, path=str(plain), tiny=False,
                                      single_file_config=str(spec.path))


@pytest.mark.parametrize("layout", ["comfy_quant", "gguf_q8_0"])
def test_a_lora_trained_on_a_quantized_file_merges_into_it_as_comfyui_merges(tiny, tmp_path,
                                                                              capsys, layout):
    import dataclasses

    plain, model = tiny
    if layout == "comfy_quant":
        file = comfy_quant_copy(plain, tmp_path / "flux1-dev-8bit.safetensors", formats=EIGHT_BIT)
    else:
        file = write_gguf_copy(plain, tmp_path / "flux1-dev-Q8_0.gguf", "Q8_0", "flux")

    def spec_of(path):
        return build_spec(dataclasses.replace(model, path=str(path)))

    spec = spec_of(file)
    trained = adapted(spec.load_denoiser(torch.float32), SimpleNamespace(model=model), spec,
                      seed=2)
    export_lora(spec, adapter_state(trained), tmp_path / "export")
    comfy = tmp_path / "export" / "flux_lora_comfyui.safetensors"
    merged = tmp_path / f"merged{file.suffix}"
    main(["merge", f"base={file}", f"lora={comfy}", f"out={merged}"])
    assert f"merged 1 LoRA(s) into {merged}" in capsys.readouterr().out

    lora = load_file(comfy)
    if layout == "comfy_quant":
        want, got, before = comfyui_merged(file, lora), load_file(merged), load_file(file)
        assert got.keys() == want.keys()
        for key, value in want.items():
            if key.endswith(".weight") and value.dtype in DTYPES.values():
                scale = want[key.removesuffix(".weight") + ".weight_scale"]
                torch.testing.assert_close(
                    got[key.removesuffix(".weight") + ".weight_scale"], scale, rtol=1e-6, atol=0)
                # The same rounding but where fp32 and fp64 sums straddle a rounding edge.
                steps = (got[key].float() - value.float()).abs()
                assert (steps > 0).float().mean() < 0.01 and (
                    steps <= (1 if value.dtype == torch.int8 else value.float().abs() / 4)
                ).all(), key
            elif not key.endswith(".weight_scale"):
                assert torch.equal(got[key], value), key
        changed = [k for k in before
                   if k.endswith(".weight") and not torch.equal(before[k], got[k])]
    else:
        want, got, before = gguf_merged(file, lora), gguf_values(merged), gguf_values(file)
        assert got.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)
        changed = [k for k in before
                   if k.endswith(".weight") and not torch.equal(before[k], got[k])]
    assert len(changed) == len(lora) // 2  # every adapted weight, and only those

    # Loaded back, the merged file is the trained model within the format's rounding: its
    # outputs differ from the trained model's by less than a tenth of what the LoRA changes.
    from peft.tuners.tuners_utils import BaseTunerLayer

    inputs = _inputs(spec)
    # A GGUF's Linears as plain ones of their values: the same numbers, without dequantizing
    # the blocks at every matmul.
    trained = with_plain_linears(trained)
    merged_model = with_plain_linears(spec_of(merged).load_denoiser(torch.float32))
    with torch.no_grad():
        out_trained, out_merged = (spec.denoiser_forward(m, inputs)
                                   for m in (trained, merged_model))
        for layer in trained.modules():
            if isinstance(layer, BaseTunerLayer):
                layer.enable_adapters(False)
        out_base = spec.denoiser_forward(trained, inputs)
    lora_effect = (out_trained - out_base).norm()
    assert (out_merged - out_trained).norm() < 0.1 * lora_effect


def test_layers_it_cannot_quantize_again_are_refused_and_nothing_is_written(tmp_path, capsys):
    """An nvfp4 layer (comfy_quant) and a GGUF K-quant, which the gguf package does not
    quantize: the error names the file, the weight and its format, and what to do."""
    import gguf
    import numpy as np
    from safetensors.torch import save_file

    layer = "model.diffusion_model.blocks.0.q"
    save_file({f"{layer}.weight": torch.zeros(32, 128, dtype=torch.uint8),
               f"{layer}.weight_scale": torch.zeros(512, dtype=torch.uint8),
               f"{layer}.weight_scale_2": torch.tensor(1.0),
               f"{layer}.comfy_quant": torch.tensor(list(b'{"format": "nvfp4"}'),
                                                    dtype=torch.uint8)},
              tmp_path / "nvfp4.safetensors")
    writer = gguf.GGUFWriter(str(tmp_path / "q4_k.gguf"), arch="flux")
    writer.add_tensor("blocks.0.q.weight", np.zeros((32, 144), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_K)  # 32 rows of 256 values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for base, width, says in (
            ("nvfp4.safetensors", 256, f"{layer}.weight is an nvfp4 layer: dpipe-lora merges "
                                       "into ComfyUI's 8-bit layers"),
            ("q4_k.gguf", 256, "blocks.0.q.weight is Q4_K, which the gguf package does not "
                               "quantize")):
        save_file({"diffusion_model.blocks.0.q.lora_A.weight": torch.ones(4, width),
                   "diffusion_model.blocks.0.q.lora_B.weight": torch.ones(32, 4)},
                  tmp_path / "lora.safetensors")
        out = tmp_path / f"merged-{base}"
        with pytest.raises(SystemExit) as exit_:
            main(["merge", f"base={tmp_path / base}", f"lora={tmp_path / 'lora.safetensors'}",
                  f"out={out}"])
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err
        assert not out.exists() and not list(tmp_path.glob(".merged-*"))
