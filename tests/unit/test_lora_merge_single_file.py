"""`dpipe-lora merge base=<single file> lora=<file> model=<family>` for the families whose single
files keep original names (those with a `to_original` converter): each LoRA format dpipe writes
for the family (its diffusers file, its ComfyUI file) and one it reads (kohya's names, made from
the ComfyUI file as sd-scripts and musubi-tuner write them) lands on every weight it changes, the
merged file equal to the merge into the diffusers folder converted to the file's names.
Chroma's and Krea 2's ComfyUI LoRAs carry diffusers' names (ComfyUI applies them by those), which
no module of their files has: refused before `lora_names.base_names`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dpipe.cli.lora import main
from dpipe.config.compose import compose_run
from dpipe.models import lora_tools
from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.lora_names import flat, lora_names, split_key
from dpipe.models.lora_read import strip_prefix
from dpipe.models.registry import build_spec
from tests.exports import adapted, adapter_state, export_lora

FAMILIES = ["chroma", "krea2", "sd3", "wan", "hunyuan_video", "ltx_video", "ltx2", "cosmos1",
            "cosmos_predict2", "auraflow"]


def _file_names(to_original, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` in the file's names; Krea 2's converter names its Linears only (dpipe writes no
    Krea 2 single file): its file holds those, as the file in docs/bench-results' ComfyUI check."""
    try:
        return to_original(state)
    except KeyError:
        kept = {}
        for key, value in state.items():
            try:
                kept.update(to_original({key: value}))
            except KeyError:
                continue
        return kept


def _as_kohya(comfy: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ComfyUI LoRA as kohya's sd-scripts and musubi-tuner name theirs: `lora_unet_` and the
    module's name (after `diffusion_model.` or `transformer.`, ComfyUI takes both) with dots as
    underscores, lora_down / lora_up, and an `.alpha` each: the file's, or its rank where the
    file folds its scale into B."""
    parts = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight",
             "alpha": "alpha"}
    out = {}
    for key, value in comfy.items():
        module, part = split_key(key)
        name = "lora_unet_" + flat(strip_prefix(module)[0])
        out[f"{name}.{parts[part]}"] = value
        if part == "lora_A.weight" and f"{module}.alpha" not in comfy:
            out[f"{name}.alpha"] = torch.tensor(float(value.shape[0]))
    return out


def _folder_weights(folder) -> dict[str, torch.Tensor]:
    weights = {}
    for file in lora_tools.weight_files(folder):
        weights.update(load_file(file))
    return weights


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_lora_format_merges_into_the_single_file_as_into_the_folder(family, tmp_path,
                                                                          capsys):
    run = compose_run([f"model=tiny_{family}", "model.lora.alpha=2"])
    spec = build_spec(run.model)
    spec.ensure_available()
    written = export_lora(spec, adapter_state(adapted(spec.load_denoiser(torch.float32), run,
                                                      spec, 2)), tmp_path / "export")
    loras = [p for p in written if p.suffix == ".safetensors"]
    comfy = [p for p in loras if p.name != DIFFUSERS_LORA]
    assert comfy, f"{family} writes no ComfyUI LoRA"
    save_file(_as_kohya(load_file(comfy[0])), tmp_path / "kohya.safetensors")
    loras.append(tmp_path / "kohya.safetensors")

    to_original = type(spec).to_original
    folder = spec.path / spec.denoiser_folder
    base = _file_names(to_original, _folder_weights(folder))
    save_file({k: v.contiguous() for k, v in base.items()}, tmp_path / "file.safetensors")
    lora_tools.merge(folder, [(tmp_path / "export" / DIFFUSERS_LORA, 1.0)], tmp_path / "folder",
                     names=lora_names(spec, lora_tools.weight_shapes(
                         lora_tools.weight_files(folder))))
    expected = _file_names(to_original, _folder_weights(tmp_path / "folder"))
    changed = {k for k in base if not torch.equal(expected[k], base[k])}
    assert changed

    for lora in loras:
        out = tmp_path / f"merged-{lora.name}"
        main(["merge", f"base={tmp_path / 'file.safetensors'}", f"lora={lora}",
              f"model=tiny_{family}", f"out={out}"])
        merged = load_file(out)
        assert sorted(merged) == sorted(base)
        for key in base:
            # within the stored dtype's rounding: the ComfyUI file's scale is folded into B, and
            # a fused weight's shares are one product (lora_read._stacked), not several
            torch.testing.assert_close(merged[key], expected[key],
                                       msg=lambda m: f"{lora.name}, {key}: {m}")
    capsys.readouterr()

    # a module the family lacks is named, nothing written
    odd = load_file(tmp_path / "export" / DIFFUSERS_LORA)
    odd["transformer.no_such_block.lora_A.weight"] = torch.zeros(4, 8)
    odd["transformer.no_such_block.lora_B.weight"] = torch.zeros(8, 4)
    save_file(odd, tmp_path / "odd.safetensors")
    with pytest.raises(SystemExit):
        main(["merge", f"base={tmp_path / 'file.safetensors'}",
              f"lora={tmp_path / 'odd.safetensors'}", f"model=tiny_{family}",
              f"out={tmp_path / 'odd-merged.safetensors'}"])
    said = capsys.readouterr().err
    assert "1 of its" in said and "fit no module of" in said
    assert "transformer.no_such_block" in said
    assert not (tmp_path / "odd-merged.safetensors").exists()
