"""ComfyUI's per-layer quantized single files (`comfy_quant`, `weight_scale`; float8, int8, int8
convrot, nvfp4, mxfp8) on the tiny FLUX model's Black Forest Labs-layout file: read by the
layout's rules, the 8-bit ones kept in their stored form as a LoRA's frozen base.

The file is written here with the key names and JSON that ComfyUI 0.33.0 (upstream 783545f6,
2026-08-22) reads in `comfy/ops.py` (a uint8 `<layer>.comfy_quant` tensor of JSON bytes, or the
header's `_quantization_metadata`), and the dequantization rules below are those of the
comfy-kitchen 0.2.31 layouts ComfyUI names in `comfy/quant_ops.py` (eager backend: `TensorCoreFP8
Layout`, `TensorWiseINT8Layout` with `convrot`, `TensorCoreNVFP4Layout`, `TensorCoreMXFP8Layout`,
block scales in cuBLAS's tiled order), written out here independently of dpipe's code."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dpipe.config.compose import compose_run
from dpipe.errors import ModelLoadError
from dpipe.models.flux.tiny import write_bfl_single_file
from dpipe.models.registry import build_spec

PREFIX = "model.diffusion_model."
# BFL layer -> (comfy_quant format, convrot group or 0); the other 2-D weights of the blocks and
# the final layer's modulation are float8_e4m3fn; the embedders stay bf16, as in ComfyUI's files.
FORMATS = {"img_attn.qkv": ("float8_e4m3fn", 0), "txt_attn.qkv": ("float8_e5m2", 0),
           "linear1": ("int8_tensorwise", 0), "linear2": ("int8_tensorwise", 16),
           "img_mlp.0": ("int8_tensorwise", 16), "img_mlp.2": ("int8_tensorwise", 64),
           "img_mod.lin": ("nvfp4", 0), "modulation.lin": ("mxfp8", 0)}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0-7; 8-15: negated
DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
          "int8_tensorwise": torch.int8}


def regular_hadamard(n: int) -> torch.Tensor:
    """comfy-kitchen's ConvRot matrix: Kronecker powers of the 4x4 regular Hadamard, / sqrt(n)."""
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]],
                      dtype=torch.float64)
    h = h4
    while h.shape[0] < n:
        h = torch.kron(h, h4)
    return h / math.sqrt(n)


def by_groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """W @ H^T over each group of `group` input columns (comfy-kitchen's `_rotate_weight`)."""
    rows, cols = w.shape
    return (w.reshape(rows, cols // group, group) @ regular_hadamard(group).T.to(w.dtype)
            ).reshape(rows, cols)


def tiled(scales: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) block-scale matrix in cuBLAS's tiled order for block-scaled matmuls (the
    order comfy-kitchen's `to_blocked` writes): zero-padded to blocks of 128 rows x 4 columns,
    block after block, in a block row r0 + 32 r1 and column c at r0 * 16 + r1 * 4 + c."""
    rows, cols = scales.shape
    row_blocks, col_blocks = -(-rows // 128), -(-cols // 4)
    out = torch.zeros(row_blocks * col_blocks * 512, dtype=scales.dtype)
    for r in range(rows):
        for c in range(cols):
            block = (r // 128) * col_blocks + c // 4
            r1, r0 = divmod(r % 128, 32)
            out[block * 512 + r0 * 16 + r1 * 4 + c % 4] = scales[r, c]
    return out


def untiled(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    col_blocks = -(-cols // 4)
    out = torch.empty(rows, cols, dtype=flat.dtype)
    for r in range(rows):
        for c in range(cols):
            r1, r0 = divmod(r % 128, 32)
            out[r, c] = flat[((r // 128) * col_blocks + c // 4) * 512 + r0 * 16 + r1 * 4 + c % 4]
    return out


def nvfp4(w: torch.Tensor):
    """(packed codes, tiled e4m3 block scales, tensor scale) as comfy-kitchen's nvfp4 quantizer
    lays them out: 16 values a block scale, e2m1 codes nearest, high nibble first."""
    tensor_scale = w.abs().max() / (448 * 6)
    blocks = w.reshape(w.shape[0], -1, 16)
    block_scale = (blocks.abs().amax(-1) / 6 / tensor_scale).clamp(min=2 ** -9).to(
        torch.float8_e4m3fn)
    x = blocks / (block_scale.float() * tensor_scale)[..., None]
    codes = (x.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (x < 0)
    codes = codes.reshape(w.shape[0], -1).to(torch.uint8)
    return (codes[:, 0::2] << 4) | codes[:, 1::2], tiled(block_scale.view(torch.uint8)), \
        tensor_scale.reshape(())


def mxfp8(w: torch.Tensor):
    """(e4m3 values, tiled e8m0 block scales): a power of two 2^(e - 127) per 32 values."""
    blocks = w.reshape(w.shape[0], -1, 32)
    exponent = (torch.log2(blocks.abs().amax(-1) / 448).ceil() + 127).clamp(1, 254)
    q = (blocks / torch.exp2(exponent - 127)[..., None]).reshape(w.shape).to(torch.float8_e4m3fn)
    return q, tiled(exponent.to(torch.uint8))


def layer_format(key: str, formats: dict = FORMATS) -> tuple[str, int] | None:
    name = key.removeprefix(PREFIX).removesuffix(".weight")
    for part, fmt in formats.items():
        if name.endswith(part):
            return fmt
    if "blocks." in name or name.startswith("final_layer.adaLN"):
        return ("float8_e4m3fn", 0)
    return None


def comfy_quant_copy(plain: Path, out: Path, in_header: bool = False,
                     odd: dict | None = None, formats: dict = FORMATS) -> Path:
    """`plain` quantized as ComfyUI's quantizers write it: fp8 with one absmax scale per tensor,
    int8 tensor-wise, int8 convrot rotated and then scaled per row; `odd`: extra layer objects;
    `formats`: {BFL layer name's end: (format, convrot group)}, the other block layers fp8."""
    state, layers = {}, {}
    for key, value in load_file(plain).items():
        fmt = (layer_format(key, formats) if key.endswith(".weight") and value.dim() == 2
               else None)
        if fmt is None:
            state[key] = value
            continue
        name, group = fmt
        layer = key.removesuffix(".weight")
        w = value.to(torch.float32)
        layers[layer] = {"format": name}
        if name == "nvfp4":
            state[key], state[f"{layer}.weight_scale"], state[f"{layer}.weight_scale_2"] = nvfp4(w)
            continue
        if name == "mxfp8":
            state[key], state[f"{layer}.weight_scale"] = mxfp8(w)
            continue
        if group:  # rows rotated, then a scale per row (the convrot quantizer's rowwise int8)
            w = by_groups(w.double(), group).float()
            scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-30)
        else:
            top = 127.0 if name.startswith("int8") else torch.finfo(DTYPES[name]).max
            scale = w.abs().amax() / top
        q = w / scale
        q = q.round().clamp(-128, 127) if name.startswith("int8") else q
        state[key] = q.to(DTYPES[name])
        state[f"{layer}.weight_scale"] = scale.float()
        if name.startswith("float8"):
            state[f"{layer}.input_scale"] = torch.tensor(1.0)
        conf = {"format": name, **({"convrot": True, "convrot_groupsize": group} if group else {})}
        layers[layer] = conf
    for layer, conf in (odd or {}).items():
        layers[layer] = conf
    metadata = {"format": "pt"}
    if in_header:
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0",
                                                         "layers": layers})
    else:
        for layer, conf in layers.items():
            state[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()),
                                                         dtype=torch.uint8)
    save_file(state, str(out), metadata=metadata)
    return out


def dequantized_copy(file: Path, out: Path) -> Path:
    """The file's values by ComfyUI's rules, as a plain fp32 file: fp8 and int8 value * scale,
    convrot then rotated back, (value * scale) @ H per group (H = H^T = H^-1)."""
    state = load_file(file)
    layers = {k.removesuffix(".comfy_quant"): json.loads(bytes(v.tolist()))
              for k, v in state.items() if k.endswith(".comfy_quant")}
    plain = {}
    for key, value in state.items():
        layer = key.removesuffix(".weight")
        if key.endswith((".comfy_quant", ".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if layer not in layers:
            plain[key] = value
            continue
        fmt = layers[layer]["format"]
        if fmt in ("nvfp4", "mxfp8"):
            block = 16 if fmt == "nvfp4" else 32
            scales = state[f"{layer}.weight_scale"]
            if fmt == "nvfp4":  # high nibble first; codes 8-15 are the negated 0-7
                codes = torch.stack([value >> 4, value & 15], -1).reshape(value.shape[0], -1)
                values = E2M1[codes.long() % 8] * (1 - 2 * (codes >= 8).float())
                per_block = untiled(scales, value.shape[0], values.shape[1] // block).view(
                    torch.float8_e4m3fn).float() * state[f"{layer}.weight_scale_2"]
            else:
                values = value.float()
                exponent = untiled(scales, value.shape[0], value.shape[1] // block).float()
                per_block = torch.exp2(exponent - 127)
            plain[key] = (values.reshape(value.shape[0], -1, block) * per_block[..., None]
                          ).reshape(values.shape)
            continue
        w = value.double() * state[f"{layer}.weight_scale"].double()
        if layers[layer].get("convrot"):
            w = by_groups(w, layers[layer]["convrot_groupsize"])
        plain[key] = w.float()
    save_file(plain, str(out))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the session's tiny FLUX diffusers folder, its transformer as one plain BFL-layout file)."""
    run = compose_run(["model=tiny_flux", "dataset=synthetic", "dataset.path=/unused"])
    spec = build_spec(run.model)
    spec.ensure_available()
    root = tmp_path_factory.mktemp("comfy_quant")
    return spec.path, write_bfl_single_file(spec.path, root / "flux1-dev.safetensors", PREFIX)


def _run(file: Path, folder: Path, *overrides):
    run = compose_run(["model=tiny_flux", f"model.path={file}", "model.tiny=false",
                       f"model.single_file_config={folder}", "dataset=synthetic",
                       "dataset.path=/unused", "train.precision=bf16", "model.lora.rank=4",
                       *overrides])
    spec = build_spec(run.model)
    spec.ensure_available()
    return spec, run


def test_values_follow_the_layouts_rules_and_linears_keep_the_stored_bytes(tiny, tmp_path):
    folder, plain = tiny
    file = comfy_quant_copy(plain, tmp_path / "flux1-dev-mixed.safetensors")
    spec, _ = _run(file, folder)
    model = spec.load_denoiser(torch.float32)
    want = _run(dequantized_copy(file, tmp_path / "deq.safetensors"), folder)[0].load_denoiser(
        torch.float32).state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)
    stored = load_file(file)
    forms = {name: m.stored_form for name, m in model.named_modules() if "stored_form" in vars(m)}
    # Every Linear of an 8-bit layer keeps its form: per double block qkv split in three
    # (twice), two out projections, four MLP Linears, the text modulation; per single block
    # linear1 split in four, linear2; the final layer's modulation. The nvfp4 and mxfp8
    # modulations are values only.
    assert len(forms) == 2 * (3 + 3 + 2 + 4 + 1) + 2 * (4 + 1) + 1
    assert not any(name.endswith(("norm1.linear", "norm.linear")) for name in forms)
    block = "transformer_blocks.0.attn"
    fused = torch.cat([forms[f"{block}.{p}"].values for p in ("to_q", "to_k", "to_v")])
    assert torch.equal(fused.view(torch.uint8),
                       stored[f"{PREFIX}double_blocks.0.img_attn.qkv.weight"].view(torch.uint8))
    for name, bfl, dtype in (("single_transformer_blocks.1.proj_out", "single_blocks.1.linear2",
                              torch.int8),
                             (f"{block}.add_q_proj", "double_blocks.0.txt_attn.qkv",
                              torch.float8_e5m2)):
        values = stored[f"{PREFIX}{bfl}.weight"]
        assert forms[name].values.dtype == dtype
        assert torch.equal(forms[name].values.view(torch.uint8),
                           values[:forms[name].values.shape[0]].view(torch.uint8)), name
    assert forms["single_transformer_blocks.1.proj_out"].group == 16


def test_the_header_metadata_reads_as_the_comfy_quant_keys(tiny, tmp_path):
    """Older files name the layers in the safetensors header (`_quantization_metadata`)."""
    from dpipe.models.single_file import read_single_file

    _, plain = tiny
    keys = read_single_file(comfy_quant_copy(plain, tmp_path / "keys.safetensors"), torch.float32)
    header = read_single_file(comfy_quant_copy(plain, tmp_path / "header.safetensors", True),
                              torch.float32)
    assert keys.keys() == header.keys() and not any("comfy_quant" in k for k in keys)
    assert all(torch.equal(keys[k], header[k]) for k in keys)


@pytest.mark.slow  # a tiny model made trainable and stepped in this process: 3-8 s on 2 cores
def test_a_lora_trains_on_the_stored_form(tiny, tmp_path):
    """The blocks' frozen Linears hold the file's bytes (no second rounding), start from the loss
    of the same layers over plain bf16 Linears of those values, and train as a LoRA."""
    import copy

    from peft.tuners.lora import Linear as LoraLinear

    from dpipe.bench.worker import fixed_micro_batches
    from dpipe.train.fp8 import QuantizedLinear
    from dpipe.train.stored_base import RotatedQuantizedLinear
    from dpipe.train.trainable import trainable_layers

    folder, plain = tiny
    spec, run = _run(comfy_quant_copy(plain, tmp_path / "flux1-dev-mixed.safetensors"), folder)
    layers = trainable_layers(spec, run)
    wrapped = [m for layer in layers for m in layer.modules() if isinstance(m, LoraLinear)]
    bases = [m.base_layer for m in wrapped]
    # The nvfp4 and mxfp8 modulations (values only) stay plain Linears, in bf16.
    plain_bases = [m.base_layer for layer in layers for n, m in layer.named_modules()
                   if isinstance(m, LoraLinear) and n.endswith(("norm1.linear", "norm.linear"))]
    assert all(type(b) is torch.nn.Linear for b in plain_bases)
    assert bases and all(isinstance(b, QuantizedLinear) for b in bases if b not in plain_bases)
    assert sum(isinstance(b, RotatedQuantizedLinear) for b in bases) == 2 * (1 + 1 + 1)
    assert {b.weight.dtype for b in bases if b not in plain_bases} == set(DTYPES.values())
    assert plain_bases and {b.weight.dtype for b in plain_bases} == {torch.bfloat16}
    assert not any("stored_form" in vars(m) for layer in layers for m in layer.modules())
    reference = copy.deepcopy(layers)
    for module in (m for layer in reference for m in layer.modules()):
        if isinstance(module, LoraLinear) and isinstance(module.base_layer, QuantizedLinear):
            base = module.base_layer
            linear = torch.nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
            linear.weight.data = base.dequantized().to(torch.bfloat16)
            if base.bias is not None:
                linear.bias.data = base.bias.data
            module.base_layer = linear.requires_grad_(False)
    (inputs, labels), = fixed_micro_batches(spec, "tiny", 1, 2, seed=0)

    def loss_of(stack):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = inputs
            for layer in stack:
                x = layer(x)
            return spec.loss(x, labels)

    with torch.no_grad():
        start = loss_of(reference).item()
    opt = torch.optim.AdamW([p for layer in layers for p in layer.parameters()
                             if p.requires_grad], lr=3e-2)
    losses = []
    for _ in range(2):
        loss = loss_of(layers)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(losses[0], start, rtol=0.01, atol=0)
    assert losses[1] < losses[0]


def test_a_full_fine_tune_and_dpipes_own_storage_use_the_values(tiny, tmp_path):
    folder, plain = tiny
    file = comfy_quant_copy(plain, tmp_path / "flux1-dev-mixed.safetensors")
    from dpipe.models.single_file import keeps_stored_base

    for overrides in (["model.mode=full", "pipeline.zero_stage=1"], ["model.base_dtype=int8"]):
        spec, run = _run(file, folder, *overrides)
        assert not keeps_stored_base(run.model), overrides
    model = spec.load_denoiser(torch.float32)  # the values, as a plain base
    assert not any("stored_form" in vars(m) for m in model.modules())


def test_8bit_matmuls_multiply_the_file_s_bytes_where_it_stores_their_format(tiny, tmp_path):
    """model.base_compute=fp8|int8 on a kept file: a block Linear the file stores in the
    matmul's format (float8_e4m3fn for fp8, int8 without convrot for int8) multiplies the file's
    bytes and scales as they are; the others (e5m2, convrot, the other format) are quantized from
    their values, as on a bf16 file."""
    import copy
    import dataclasses

    from dpipe.config.schema import BaseCompute
    from dpipe.models.single_file import keeps_stored_base
    from dpipe.train.fp8 import QuantizedLinear
    from dpipe.train.fp8_compute import Fp8Linear, use_fp8_compute
    from dpipe.train.int8_compute import Int8Linear, use_int8_compute

    folder, plain = tiny
    file = comfy_quant_copy(plain, tmp_path / "flux1-dev-mixed.safetensors")
    spec, run = _run(file, folder, "model.base_compute=fp8")
    assert keeps_stored_base(run.model)
    assert keeps_stored_base(dataclasses.replace(run.model, base_compute=BaseCompute.int8))
    loaded = spec.load_denoiser(torch.float32).requires_grad_(False)  # a LoRA's frozen base
    forms = {name: m.stored_form for name, m in loaded.named_modules() if "stored_form" in vars(m)}
    stored = load_file(file)
    # fp8: double block 0's image q, k, v from the file's fused e4m3 qkv; int8: single block 0's
    # q, k, v and MLP input from its int8 tensor-wise linear1. fp8 keeps, per double block, the
    # image q, k, v, both out projections, the text MLP and modulation (16 Linears); int8 per
    # single block linear1 split in four (8).
    for fast, use, storage, parts, layer, kept in (
            (Fp8Linear, use_fp8_compute, torch.float8_e4m3fn,
             [f"transformer_blocks.0.attn.{p}" for p in ("to_q", "to_k", "to_v")],
             "double_blocks.0.img_attn.qkv", 16),
            (Int8Linear, use_int8_compute, torch.int8,
             [f"single_transformer_blocks.0.{p}" for p in ("attn.to_q", "attn.to_k",
                                                           "attn.to_v", "proj_mlp")],
             "single_blocks.0.linear1", 8)):
        model = copy.deepcopy(loaded)
        assert use(model) > 0
        assert not any("stored_form" in vars(m) for m in model.modules())
        modules = dict(model.named_modules())
        own = 0
        for name, form in forms.items():
            module = modules[name]
            if not isinstance(module, QuantizedLinear):  # outside the blocks: compute dtype
                continue
            if form.values.dtype == storage and not form.group:
                assert torch.equal(module.weight.view(torch.uint8), form.values.view(torch.uint8))
                assert torch.equal(module.scale, form.scale), name
                own += 1
            else:
                assert module.weight.dtype == storage
                assert not torch.equal(module.dequantized(), form.dequantized()), name
        assert own == kept, (fast, own)
        assert all(type(modules[p]) is fast for p in parts)
        fused = torch.cat([modules[p].weight for p in parts])
        assert torch.equal(fused.view(torch.uint8),
                           stored[f"{PREFIX}{layer}.weight"].view(torch.uint8))
        scale = stored[f"{PREFIX}{layer}.weight_scale"]
        assert torch.equal(modules[parts[0]].scale, scale.expand(len(modules[parts[0]].scale)))


def test_an_unread_layout_names_its_layers_and_the_formats_dpipe_reads(tiny, tmp_path):
    folder, plain = tiny
    layer = f"{PREFIX}double_blocks.0.img_mlp.0"
    odd = comfy_quant_copy(plain, tmp_path / "w4a4.safetensors",
                           odd={layer: {"format": "convrot_w4a4"}})
    with pytest.raises(ModelLoadError, match="layout dpipe does not read") as err:
        _run(odd, folder)[0].load_denoiser(torch.float32)
    for said in (layer, "'convrot_w4a4'", "float8_e4m3fn, float8_e5m2, int8_tensorwise",
                 "nvfp4 and mxfp8", "w4a4.safetensors"):
        assert said in str(err.value), err.value


def test_a_full_fine_tune_goes_out_as_a_plain_bf16_file_in_the_source_s_layout(tiny, tmp_path):
    """Its scales were fitted to the base weights: the trained weights go out in bf16, every
    quantization key left out (FLUX.1's writer, and the other families' shared one)."""
    from dpipe.models.common.bfl_layout import source_format
    from dpipe.models.single_file import export_like_source

    from safetensors import safe_open

    from dpipe.models.common.comfy_quant import HEADER_KEY

    _, plain = tiny
    # the layout in the header, as some files keep it: the plain export leaves it out
    file = comfy_quant_copy(plain, tmp_path / "flux1-dev-mixed.safetensors", in_header=True)
    assert source_format(file) == (PREFIX, torch.bfloat16)
    stored = load_file(file)
    trained = {k.removeprefix(PREFIX): torch.ones(v.shape[0], 32) for k, v in stored.items()
               if k.endswith("img_mod.lin.weight") or k.endswith("img_attn.qkv.weight")}
    folder = tmp_path / "trained"
    folder.mkdir()
    save_file(trained, str(folder / "model.safetensors"))
    (tmp_path / "out").mkdir()
    exported = export_like_source(folder, file, lambda weights: weights, tmp_path / "out")
    with safe_open(file, "pt") as source, safe_open(exported, "pt") as written:
        assert HEADER_KEY in source.metadata() and HEADER_KEY not in written.metadata()
        assert written.metadata() == {k: v for k, v in source.metadata().items()
                                      if k != HEADER_KEY} | {"format": "pt"}
    out = load_file(exported)
    assert not any(k.endswith(("comfy_quant", "weight_scale", "weight_scale_2", "input_scale"))
                   for k in out)
    for key in trained:  # nvfp4's packed bytes and fp8 values alike
        assert out[PREFIX + key].dtype == torch.bfloat16 and torch.equal(
            out[PREFIX + key], trained[key].bfloat16()), key


def test_the_memory_plan_counts_a_kept_file_in_8_bits(tiny, tmp_path):
    """`dpipe-train --plan` / `pipeline=auto`: a LoRA on an all-8-bit file is planned with the
    file's 8-bit base only (no model.base_dtype to add); a file with nvfp4 / mxfp8 layers, read
    as values, and a run that sets model.base_dtype are planned as before."""
    from dpipe.models.common.quantized_files import write_quantized_copy
    from dpipe.plan.choose import candidates, keeps_file_base
    from dpipe.plan.machine import parse

    folder, plain = tiny
    machine = parse("1x24,host=64")
    eight_bit = write_quantized_copy(plain, tmp_path / "flux1-dev-int8.safetensors", torch.int8)
    mixed = comfy_quant_copy(plain, tmp_path / "flux1-dev-mixed.safetensors")
    for path, overrides, kept in ((eight_bit, [], True), (mixed, [], False),
                                  (eight_bit, ["model.base_dtype=int8"], False)):
        _, run = _run(path, folder, *overrides)
        assert keeps_file_base(run) == kept, (path.name, overrides)
        bases = {fp8 for _, _, fp8 in candidates(run, machine, set())}
        assert bases == ({True} if kept else {False, True}), (path.name, overrides)
