"""LyCORIS files beyond LoKr/LoHa: LoCon on convolutions (with a Tucker core), Tucker LoHa/LoKr,
and DoRA's `dora_scale`, with the key names LyCORIS (KohakuBlueleaf/LyCORIS f49d30d,
2025-10-04: `lycoris/modules/locon.py`, `loha.py`, `lokr.py`) and kohya's SDXL names give them.
The expected weights are LyCORIS's definitions written out here: a LoCon's delta as its bypass
forward (down, mid with the layer's stride and padding, up: three convolutions), LoHa's Tucker
rebuild as loops over the rank, DoRA's W' = dora_scale * (W + dW) / ||W + dW|| over each output
row. In this process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dpipe.config.compose import compose_run
from dpipe.config.schema import Adapter
from dpipe.errors import ConfigError
from dpipe.models.adapters import is_adapter_param, module_delta
from dpipe.models.registry import build_spec
from dpipe.train.adapter_init import init_adapter, merge_adapters
from dpipe.train.lora import make_trainable
from tests.exports import adapter_from_file


def _spec(model, *more):
    run = compose_run([f"model={model}", "dataset=synthetic", "dataset.path=/unused",
                       "model.lora.alpha=2", *more])
    spec = build_spec(run.model)
    spec.ensure_available()
    return spec, run


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_tucker_loha_and_conv_lokr_deltas_are_lycoris_s():
    rank, out, inp, k = 3, 6, 4, 3
    t1, t2 = _randn(rank, rank, k, k, seed=1), _randn(rank, rank, k, k, seed=2)
    w1a, w1b = _randn(rank, out, seed=3), _randn(rank, inp, seed=4)
    w2a, w2b = _randn(rank, out, seed=5), _randn(rank, inp, seed=6)
    parts = {"hada_t1": t1, "hada_w1_a": w1a, "hada_w1_b": w1b,
             "hada_t2": t2, "hada_w2_a": w2a, "hada_w2_b": w2b}
    got = module_delta(Adapter.loha, parts, 0.5, (out, inp, k, k))

    def rebuilt(t, up, down):  # W[o, i] = sum_ab t[a, b] up[a, o] down[b, i], kernel by kernel
        w = torch.zeros(out, inp, k, k)
        for a in range(rank):
            for b in range(rank):
                w += t[a, b][None, None] * (up[a][:, None] * down[b][None, :])[..., None, None]
        return w

    want = 0.5 * rebuilt(t1, w1a, w1b) * rebuilt(t2, w2a, w2b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # LoKr on a convolution: w1 (a, c) scales whole (b, d, kh, kw) kernels of w2, and a Tucker w2
    # is its core between two factors, as LoCon's.
    w1, core = _randn(2, 2, seed=7), _randn(rank, rank, k, k, seed=8)
    w2a, w2b = _randn(rank, 3, seed=9), _randn(rank, 2, seed=10)
    lokr = {"lokr_w1": w1, "lokr_t2": core, "lokr_w2_a": w2a, "lokr_w2_b": w2b}
    got = module_delta(Adapter.lokr, lokr, 1.0, (6, 4, k, k))
    w2 = torch.einsum("abhw,ao,bi->oihw", core, w2a, w2b)
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(got[3 * i:3 * i + 3, 2 * j:2 * j + 2], w1[i, j] * w2)


@pytest.fixture(scope="module")
def sdxl():
    spec, run = _spec("tiny_sdxl")
    return spec, run


def _kohya(spec, module: str) -> str:
    from dpipe.models.sdxl.ldm import unet_module_to_sgm

    return "lora_unet_" + unet_module_to_sgm(module, spec._unet_config_dict()).replace(".", "_")


@pytest.mark.slow  # the tiny SDXL pipeline is made once a session: ~10 s when this test does it
def test_a_locon_merges_into_sdxl_s_convolutions_as_its_bypass_forward(sdxl, tmp_path):
    spec, run = sdxl
    denoiser = spec.load_denoiser(torch.float32)
    base = {n: p.detach().clone() for n, p in denoiser.named_parameters()}
    tucker, plain = "down_blocks.0.resnets.0.conv1", "down_blocks.0.resnets.0.conv2"
    linear = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    rank, alpha = run.model.lora.rank, 1.0
    file = {}
    for seed, module in enumerate((tucker, plain, linear)):
        weight = denoiser.get_submodule(module).weight
        out, inp = weight.shape[:2]
        name = _kohya(spec, module)
        if module == tucker:  # LyCORIS's use_tucker: 1x1 down and up, the kernel in the core
            file[f"{name}.lora_down.weight"] = 0.1 * _randn(rank, inp, 1, 1, seed=seed)
            file[f"{name}.lora_mid.weight"] = 0.1 * _randn(rank, rank, 3, 3, seed=seed + 10)
            file[f"{name}.lora_up.weight"] = 0.1 * _randn(out, rank, 1, 1, seed=seed + 20)
        else:
            file[f"{name}.lora_down.weight"] = 0.1 * _randn(rank, *weight.shape[1:], seed=seed)
            file[f"{name}.lora_up.weight"] = 0.1 * _randn(out, rank, *([1] * (weight.dim() - 2)),
                                                         seed=seed + 20)
        file[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(file, tmp_path / "locon.safetensors")
    merge_adapters(denoiser, [str(tmp_path / "locon.safetensors")], spec)
    x = _randn(1, 32, 8, 8, seed=99)
    for module in (tucker, plain):
        conv = denoiser.get_submodule(module)
        name = _kohya(spec, module)
        d, u = file[f"{name}.lora_down.weight"], file[f"{name}.lora_up.weight"]
        args = {"stride": conv.stride, "padding": conv.padding}
        if module == tucker:
            bypass = F.conv2d(F.conv2d(F.conv2d(x, d), file[f"{name}.lora_mid.weight"], **args), u)
        else:
            bypass = F.conv2d(F.conv2d(x, d, **args), u)
        want = F.conv2d(x, base[f"{module}.weight"], base[f"{module}.bias"], **args) \
            + alpha / rank * bypass
        torch.testing.assert_close(conv(x), want, rtol=1e-4, atol=1e-5, msg=module)
    name = _kohya(spec, linear)
    torch.testing.assert_close(
        denoiser.get_submodule(linear).weight, base[f"{linear}.weight"] + alpha / rank
        * file[f"{name}.lora_up.weight"] @ file[f"{name}.lora_down.weight"])
    # A Tucker core has no place in the adapters dpipe trains: continuing the file is refused;
    # without it, a run that adapts the convolution (peft's conv LoRA: A (r, in, kh, kw), B
    # (out, r, 1, 1), LoCon's shapes) starts from the file (its scale refolded into B).
    run.model.lora.init_from = str(tmp_path / "locon.safetensors")
    run.model.lora.targets = [plain, linear]
    make_trainable(denoiser, run.model, spec.lora_targets())
    with pytest.raises(ConfigError, match=r"Tucker core .* e\.g\. down_blocks\.0\.resnets\.0"
                                          r"\.conv1.*model\.merge_adapters"):
        init_adapter(denoiser, run.model, spec)
    save_file({k: v for k, v in file.items() if not k.startswith(_kohya(spec, tucker) + ".")},
              tmp_path / "conv.safetensors")
    run.model.lora.init_from = str(tmp_path / "conv.safetensors")
    init_adapter(denoiser, run.model, spec)
    refold = (alpha / rank) / (run.model.lora.alpha / rank)
    for module in (plain, linear):
        name, adapted = _kohya(spec, module), denoiser.get_submodule(module)
        torch.testing.assert_close(adapted.lora_A["default"].weight,
                                   file[f"{name}.lora_down.weight"])
        torch.testing.assert_close(adapted.lora_B["default"].weight,
                                   refold * file[f"{name}.lora_up.weight"])


def _lycoris_dora(state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """A peft DoRA's state under LyCORIS's names: lora_down / lora_up, the magnitude as
    `dora_scale` of shape (out, 1) (wd_on_out), an alpha."""
    out = {}
    for key, value in state.items():
        module, part = key.split(".lora_")
        name = "lycoris_" + module.replace(".", "_")
        if part.startswith("magnitude"):
            out[f"{name}.dora_scale"] = value[:, None]
        else:
            out[f"{name}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
            out[f"{name}.alpha"] = torch.tensor(alpha)
    return out


@pytest.mark.slow  # the tiny FLUX model loaded twice and adapted: ~3.5 s on 2 cores
def test_a_lycoris_dora_continues_and_merges_as_its_definition(tmp_path):
    spec, run = _spec("tiny_flux", "model.adapter=dora", "model.lora.rank=4")
    denoiser = spec.load_denoiser(torch.float32)
    base = {n: p.detach().clone() for n, p in denoiser.named_parameters()}
    make_trainable(denoiser, run.model, spec.lora_targets())
    trained = {}
    with torch.no_grad():
        for seed, (name, param) in enumerate(denoiser.named_parameters()):
            if is_adapter_param(name):
                param.add_(0.3 * _randn(*param.shape, seed=seed))
                trained[name] = param.detach().clone()
    peft_names = {k.replace(".default", ""): v for k, v in trained.items()}
    file = tmp_path / "dora.safetensors"
    save_file(_lycoris_dora(peft_names, alpha=2.0), file)
    got = adapter_from_file(denoiser, run, spec, file)
    assert got.keys() == trained.keys()
    for name, value in trained.items():
        torch.testing.assert_close(got[name], value, msg=name)

    plain = spec.load_denoiser(torch.float32)
    merge_adapters(plain, [str(file)], spec)
    module = "transformer_blocks.0.attn.to_q"
    w = base[f"{module}.weight"]
    a, b = peft_names[f"{module}.lora_A.weight"], peft_names[f"{module}.lora_B.weight"]
    adapted = w + 2.0 / 4 * b @ a
    magnitude = peft_names[f"{module}.lora_magnitude_vector.weight"]
    want = magnitude[:, None] * adapted / adapted.norm(dim=1, keepdim=True)
    torch.testing.assert_close(plain.get_submodule(module).weight, want, rtol=1e-5, atol=1e-6)


def test_keys_dpipe_cannot_place_are_listed(tmp_path):
    spec, run = _spec("tiny_flux")
    denoiser = spec.load_denoiser(torch.float32)
    name = "lycoris_transformer_blocks_0_attn_to_q"
    diff = tmp_path / "full.safetensors"
    save_file({f"{name}.lora_down.weight": torch.zeros(4, 32),
               f"{name}.lora_up.weight": torch.zeros(32, 4), f"{name}.diff": torch.zeros(32, 32)},
              diff)
    with pytest.raises(ConfigError, match=rf"full.safetensors: 1 key\(s\) of a lora file that "
                                          rf"dpipe cannot place: {name}\.diff"):
        merge_adapters(denoiser, [str(diff)], spec)
    columns = tmp_path / "columns.safetensors"
    save_file({f"{name}.lora_down.weight": torch.zeros(4, 32),
               f"{name}.lora_up.weight": torch.zeros(32, 4),
               f"{name}.dora_scale": torch.ones(1, 32)}, columns)
    with pytest.raises(ConfigError, match=rf"dora_scale over the weight's input columns "
                                          rf"\(LyCORIS's wd_on_out=False\): {name}"):
        merge_adapters(denoiser, [str(columns)], spec)
