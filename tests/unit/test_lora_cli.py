"""`dpipe-lora` as the docs show it, in this process (`main(argv)`): extract then merge gives the
fine-tune back within what the rank leaves out, resize keeps the energy it reports, convert
round-trips, merge takes several LoRAs with weights, ema is the per-step EMA of the exports."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from dpipe.cli.lora import main
from dpipe.models.lora_files import DIFFUSERS_LORA


def _run(capsys, *argv) -> str:
    main(list(argv))
    return capsys.readouterr().out


def _fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def _low_rank(rows, cols, rank, generator):
    return torch.randn(rows, rank, generator=generator) @ torch.randn(rank, cols,
                                                                      generator=generator)


def test_extract_then_merge_gives_the_fine_tune_within_the_rank_s_error(tmp_path, capsys):
    """A single file whose fine-tune moved two matrices by rank 6 and one not at all: extract at
    rank 4 and merge back; each weight's error is exactly the singular values rank 4 leaves out
    (the best rank-4 approximation), and the printed energy is theirs. Then resize the LoRA to 2:
    it keeps the stated energy of each delta."""
    g = torch.Generator().manual_seed(0)
    base = {"model.diffusion_model.blocks.0.q.weight": torch.randn(48, 32, generator=g),
            "model.diffusion_model.blocks.0.o.weight": torch.randn(32, 48, generator=g),
            "model.diffusion_model.blocks.0.norm.weight": torch.randn(32, generator=g),
            "model.diffusion_model.head.weight": torch.randn(16, 32, generator=g)}
    tuned = dict(base)
    for key in ("model.diffusion_model.blocks.0.q.weight", "model.diffusion_model.blocks.0.o.weight"):
        tuned[key] = base[key] + 0.1 * _low_rank(*base[key].shape, 6, g)
    save_file(base, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors")
    said = _run(capsys, "extract", f"base={tmp_path / 'base.safetensors'}",
                f"tuned={tmp_path / 'tuned.safetensors'}", "rank=4",
                f"out={tmp_path / 'lora.safetensors'}")
    lora = load_file(tmp_path / "lora.safetensors")
    assert sorted({k.rsplit(".lora_", 1)[0].rsplit(".alpha")[0] for k in lora}) == [
        "diffusion_model.blocks.0.o", "diffusion_model.blocks.0.q"]
    _run(capsys, "merge", f"base={tmp_path / 'base.safetensors'}",
         f"lora={tmp_path / 'lora.safetensors'}", f"out={tmp_path / 'merged.safetensors'}")
    merged = load_file(tmp_path / "merged.safetensors")
    kept = left = 0.0
    for key, value in tuned.items():
        s = torch.linalg.svdvals(value - base[key]) if value.ndim == 2 else torch.zeros(1)
        error = (merged[key] - value).norm()
        torch.testing.assert_close(error, s[4:].norm(), rtol=1e-3, atol=1e-4)
        kept, left = kept + float((s[:4] ** 2).sum()), left + float((s[4:] ** 2).sum())
    # The figure is printed to 4 decimals; its last one depends on the SVD's summation order
    # (the thread count), so it is compared within one unit of that decimal.
    printed = float(re.search(r"energy kept: ([\d.]+)% in all", said).group(1))
    assert abs(printed - 100 * kept / (kept + left)) <= 1e-4 + 5e-5, said

    said = _run(capsys, "resize", f"lora={tmp_path / 'lora.safetensors'}", "rank=2",
                f"out={tmp_path / 'rank2.safetensors'}")
    small = load_file(tmp_path / "rank2.safetensors")
    shown = re.search(r"energy kept: ([\d.]+)% in all", said).group(1)
    kept = total = 0.0
    for module in ("diffusion_model.blocks.0.q", "diffusion_model.blocks.0.o"):
        def delta(f):
            a, b = f[f"{module}.lora_A.weight"], f[f"{module}.lora_B.weight"]
            return f[f"{module}.alpha"] / a.shape[0] * b @ a
        s = torch.linalg.svdvals(delta(lora))
        assert small[f"{module}.lora_A.weight"].shape[0] == 2
        torch.testing.assert_close((delta(small) - delta(lora)).norm(), s[2:].norm(),
                                   rtol=1e-3, atol=1e-4)
        kept, total = kept + float((s[:2] ** 2).sum()), total + float((s ** 2).sum())
    assert abs(float(shown) - 100 * kept / total) <= 1e-4 + 5e-5, said  # as above

    said = _fails(capsys, "resize", f"lora={tmp_path / 'lora.safetensors'}", "rank=5",
                  f"out={tmp_path / 'rank5.safetensors'}")
    assert "rank=5 is larger than the file's rank 4 of diffusion_model.blocks.0.o" in said
    assert not (tmp_path / "rank5.safetensors").exists()


@pytest.mark.slow
def test_convert_round_trips_and_merge_takes_several_loras_with_weights(tmp_path, capsys):
    """FLUX.1's ComfyUI export converted back gives its diffusers file's deltas and the same
    ComfyUI file; merged at 0.5 (the ComfyUI file) and 0.25 (the diffusers file) into the tiny
    model's folder, each adapted weight is the base's plus 0.75 of the delta."""
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec
    from tests.exports import adapted, adapter_state, export_lora

    run = compose_run(["model=tiny_flux", "model.lora.alpha=2"])
    spec = build_spec(run.model)
    spec.ensure_available()
    export_lora(spec, adapter_state(adapted(spec.load_denoiser(torch.float32), run, spec, 2)),
                tmp_path / "export")
    comfy = tmp_path / "export" / "flux_lora_comfyui.safetensors"
    said = _run(capsys, "convert", f"lora={comfy}", "model=tiny_flux", f"out={tmp_path / 'back'}")
    assert str(tmp_path / "back" / DIFFUSERS_LORA) in said
    original, back = (load_file(d / DIFFUSERS_LORA) for d in (tmp_path / "export",
                                                              tmp_path / "back"))
    modules = {k.rsplit(".lora_", 1)[0] for k in original}
    assert modules == {k.rsplit(".lora_", 1)[0] for k in back}
    for module in modules:
        a, b = original[f"{module}.lora_A.weight"], original[f"{module}.lora_B.weight"]
        a2, b2 = back[f"{module}.lora_A.weight"], back[f"{module}.lora_B.weight"]
        torch.testing.assert_close(b2 @ a2, 0.5 * b @ a)  # alpha 2 / rank 4 folded in
    again = load_file(tmp_path / "back" / comfy.name)
    first = load_file(comfy)
    assert sorted(again) == sorted(first)
    for key in first:
        torch.testing.assert_close(again[key], first[key])

    _run(capsys, "merge", f"base={spec.path}", f"lora={comfy}:0.5",
         f"lora={tmp_path / 'export' / DIFFUSERS_LORA}:0.25", "model=tiny_flux",
         f"out={tmp_path / 'merged'}")
    merged, base = {}, {}
    for file in (tmp_path / "merged").glob("*.safetensors"):
        merged.update(load_file(file))
        base.update(load_file(spec.path / "transformer" / file.name))
    assert (tmp_path / "merged" / "config.json").is_file()
    for module in modules:
        name = module.removeprefix("transformer.")
        a, b = original[f"{module}.lora_A.weight"], original[f"{module}.lora_B.weight"]
        weight = base[f"{name}.weight"]  # stored in bf16: merged in fp32, stored as stored
        torch.testing.assert_close(merged[f"{name}.weight"],
                                   (weight.float() + 0.75 * 0.5 * b @ a).to(weight.dtype))


def test_ema_is_the_per_step_ema_of_the_step_exports(tmp_path, capsys):
    """Three step exports (steps 10, 20, 30), each standing for the weights since the one
    before: the file equals an EMA updated step by step over those weights."""
    g = torch.Generator().manual_seed(0)
    exports = {step: {"transformer.x.lora_A.weight": torch.randn(4, 8, generator=g)}
               for step in (10, 20, 30)}
    for step, tensors in exports.items():
        (tmp_path / "run" / "lora" / f"step_{step}").mkdir(parents=True)
        save_file(tensors, tmp_path / "run" / "lora" / f"step_{step}" / DIFFUSERS_LORA,
                  metadata={"lora_adapter_metadata": json.dumps({"transformer.r": 4})})
    said = _run(capsys, "ema", f"run={tmp_path / 'run'}", "decay=0.9",
                f"out={tmp_path / 'ema.safetensors'}")
    assert "steps [10, 20, 30]" in said
    key = "transformer.x.lora_A.weight"
    ema = exports[10][key].double()  # the EMA starts at the first weights
    for step in range(1, 31):
        weights = exports[min(s for s in exports if s >= step)][key].double()
        ema = 0.9 * ema + 0.1 * weights
    torch.testing.assert_close(load_file(tmp_path / "ema.safetensors")[key], ema.float())


def test_bad_arguments_say_what_to_give(tmp_path, capsys):
    assert "dpipe-lora's commands are convert, merge" in _fails(capsys, "average")
    assert "give tuned=, rank=" in _fails(capsys, "extract", f"base={tmp_path}", f"out={tmp_path}")
    assert "rank=x: give a whole number" in _fails(
        capsys, "resize", f"lora={tmp_path}", "rank=x", f"out={tmp_path}")
    assert "give model=<family>" in _fails(capsys, "convert", f"lora={tmp_path}",
                                           f"out={tmp_path / 'o'}", "model.path=/x")


def test_merge_places_a_comfyui_lora_on_a_file_behind_nvidias_prefix(tmp_path, capsys):
    """A single file whose keys sit behind `net.` (NVIDIA's Cosmos-Predict2 and Anima files, as
    ComfyUI loads them) takes a ComfyUI LoRA (`diffusion_model.<module>`, its alpha): each
    weight becomes W + alpha / rank * B @ A under its own key. dpipe's Anima ComfyUI file was
    refused on such a file (every module "fit no module")."""
    generator = torch.Generator().manual_seed(0)
    base = {"net.blocks.0.attn.q_proj.weight": torch.randn(8, 6, generator=generator),
            "net.blocks.0.attn.q_proj.bias": torch.randn(8, generator=generator),
            "net.blocks.0.mlp.layer1.weight": torch.randn(12, 8, generator=generator)}
    save_file(base, tmp_path / "anima.safetensors")
    lora = {}
    for module in ("blocks.0.attn.q_proj", "blocks.0.mlp.layer1"):
        rows, cols = base[f"net.{module}.weight"].shape
        lora[f"diffusion_model.{module}.lora_A.weight"] = torch.randn(2, cols, generator=generator)
        lora[f"diffusion_model.{module}.lora_B.weight"] = torch.randn(rows, 2, generator=generator)
        lora[f"diffusion_model.{module}.alpha"] = torch.tensor(4.0)
    save_file(lora, tmp_path / "lora.safetensors")
    _run(capsys, "merge", f"base={tmp_path / 'anima.safetensors'}",
         f"lora={tmp_path / 'lora.safetensors'}", f"out={tmp_path / 'merged.safetensors'}")
    merged = load_file(tmp_path / "merged.safetensors")
    assert sorted(merged) == sorted(base)
    for module in ("blocks.0.attn.q_proj", "blocks.0.mlp.layer1"):
        a = lora[f"diffusion_model.{module}.lora_A.weight"]
        b = lora[f"diffusion_model.{module}.lora_B.weight"]
        torch.testing.assert_close(merged[f"net.{module}.weight"],
                                   base[f"net.{module}.weight"] + 4.0 / 2 * b @ a)
    bias = "net.blocks.0.attn.q_proj.bias"
    assert torch.equal(merged[bias], base[bias])
