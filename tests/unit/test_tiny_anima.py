"""The tiny Anima folder loads and generates through diffusers' AnimaModularPipeline; its single
file, LoRA files, full export and the adapter's own learning rate work as documented
(docs/models/anima.md)."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dpipe.errors import ModelLoadError
from dpipe.models.anima.tiny import REPO, make_tiny_anima, write_single_file
from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision
from tests.unit.video_checks import assert_same_tensors
from tests.exports import export_lora


@pytest.fixture(scope="module")
def folder(tiny_models) -> Path:
    return make_tiny_anima(tiny_models / "tiny-anima")


def _spec(folder: Path, *overrides: str):
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec

    run = compose_run(["model=tiny_anima", f"model.path={folder}", "dataset=synthetic",
                       *overrides])
    spec = build_spec(run.model)
    spec.ensure_available()
    return run, spec


def test_modular_pipeline_generates_with_its_defaults(folder):
    """The pipeline's own defaults (guidance 4.0 with the empty negative prompt, 512 tokens, PIL
    output) at a small size and 2 steps."""
    from diffusers import AnimaModularPipeline

    pipe = AnimaModularPipeline.from_pretrained(str(folder))
    pipe.load_components(torch_dtype=torch.float32)
    assert pipe.guider.guidance_scale == 4.0
    with nearest_resize_without_torchvision():
        images = pipe(prompt="a red circle on a blue background", height=64, width=64,
                      num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                      output="images")
    assert isinstance(images[0], Image.Image) and images[0].size == (64, 64)
    assert any(lo < hi for lo, hi in images[0].getextrema())


def test_folder_is_laid_out_as_the_release(folder):
    index = json.loads((folder / "modular_model_index.json").read_text())
    assert index["_class_name"] == "AnimaModularPipeline"
    for name in ("transformer", "text_conditioner", "text_encoder", "tokenizer", "t5_tokenizer",
                 "vae", "scheduler"):
        spec = index[name][2]
        assert spec["pretrained_model_name_or_path"] == REPO and spec["subfolder"] == name
        assert (folder / name).is_dir()
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    with safe_open(next((folder / "text_conditioner").glob("*.safetensors")), "pt") as f:
        assert f.get_tensor("blocks.0.cross_attn.k_proj.weight").dtype == torch.bfloat16


def test_text_adapter_trains_with_its_own_learning_rate(folder):
    """The documented override; in a full fine-tune every adapter weight trains at its rate,
    with LoRA the default targets put adapters on it."""
    from dpipe.train.optim import build_optimizer
    from dpipe.train.trainable import trainable_layers

    group = 'optim.param_groups=[{match: "^text_conditioner\\.", lr: 2e-5}]'
    for mode in ("full", "lora"):
        run, spec = _spec(folder, f"model.mode={mode}", "optim.lr=1e-4", group)
        named = [(n, p) for layer in trainable_layers(spec, run)
                 for n, p in layer.source_named_parameters() if p.requires_grad]
        adapter = {id(p) for n, p in named if n.startswith("text_conditioner.")}
        assert adapter, f"{mode}: nothing of the text adapter trains"
        if mode == "lora":
            assert all("lora_" in n for n, p in named)
        optimizer = build_optimizer(named, run.optim)
        for g in optimizer.param_groups:
            ids = {id(p) for p in g["params"]}
            assert ids <= adapter if g["lr"] == 2e-5 else not ids & adapter, g["dpipe_role"]
        assert sum(len(g["params"]) for g in optimizer.param_groups if g["lr"] == 2e-5) \
            == len(adapter)


def test_single_file_loads_and_full_export_keeps_its_layout(folder, tmp_path):
    file = write_single_file(folder, tmp_path / "anima-tiny.safetensors")
    with safe_open(file, "pt") as f:
        keys = set(f.keys())
    assert "net.llm_adapter.blocks.0.self_attn.q_proj.weight" in keys
    assert "net.blocks.0.self_attn.q_proj.weight" in keys
    _, spec = _spec(folder, f"model.path={file}", f"model.single_file_config={folder}")
    _, base = _spec(folder)
    loaded = spec.load_denoiser(torch.float32).state_dict()
    expected = base.load_denoiser(torch.float32).state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    # at bf16, every parameter and buffer as from_pretrained loads the folder's
    assert_same_tensors(spec.load_denoiser(torch.bfloat16), base.load_denoiser(torch.bfloat16))

    trained = {k: v + 1 for k, v in expected.items()}  # as the trainer's stage shards name them
    names = sorted(trained)
    shards = [tmp_path / "stage-0.safetensors", tmp_path / "stage-1.safetensors"]
    save_file({k: trained[k] for k in names[:40]}, shards[0])
    save_file({k: trained[k] for k in names[40:]}, shards[1])
    spec.export_full(shards, tmp_path / "model")
    exported = spec.load_exported_full(tmp_path / "model").state_dict()
    assert all(torch.equal(exported[k], trained[k]) for k in names)
    written = load_file(tmp_path / "model" / file.name)
    assert set(written) == keys
    assert torch.equal(written["net.llm_adapter.out_proj.weight"],
                       trained["text_conditioner.out_proj.weight"].bfloat16())


def test_another_familys_folder_or_file_is_refused_naming_it(folder, tmp_path):
    from dpipe.models.cosmos_predict2.tiny import make_tiny_cosmos_predict2
    from dpipe.models.cosmos_predict2.tiny import write_single_file as cosmos_file

    cosmos = make_tiny_cosmos_predict2(tmp_path / "cosmos")
    with pytest.raises(ModelLoadError, match=r"Cosmos2TextToImagePipeline folder.*model=cosmos_predict2"):
        _spec(cosmos)
    file = cosmos_file(cosmos, tmp_path / "cosmos.safetensors")
    _, spec = _spec(folder, f"model.path={file}", f"model.single_file_config={folder}")
    with pytest.raises(ModelLoadError, match=rf"{file}.*plain Cosmos-Predict2"):
        spec.load_denoiser(torch.float32)
    other = tmp_path / "other.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2)}, other)
    _, spec = _spec(folder, f"model.path={other}", f"model.single_file_config={folder}")
    with pytest.raises(ModelLoadError, match=rf"{other} is not an Anima single file.*input_blocks"):
        spec.load_denoiser(torch.float32)


def test_lora_files_load_in_diffusers_as_trained(folder, tmp_path):
    """A LoRA on the transformer and the adapter: the diffusers file and the ComfyUI file, each
    loaded by AnimaLoraLoaderMixin, give the same model, and it differs from the base."""
    from dpipe.models.anima.spec import COMFYUI_LORA
    from dpipe.train.trainable import trainable_layers

    run, spec = _spec(folder, "model.lora.rank=2", "model.lora.alpha=3")
    g = torch.Generator().manual_seed(0)
    state = {}
    for layer in trainable_layers(spec, run):
        for name, p in layer.source_named_parameters():
            if p.requires_grad:
                state[name] = torch.randn(p.shape, generator=g) * 0.3
    assert any(k.startswith("text_conditioner.") for k in state)
    written = export_lora(spec, state, tmp_path)
    assert [p.name for p in written] == ["pytorch_lora_weights.safetensors", COMFYUI_LORA]
    with safe_open(tmp_path / COMFYUI_LORA, "pt") as f:
        assert "diffusion_model.llm_adapter.blocks.0.self_attn.q_proj.lora_A.weight" in f.keys()
    base = spec.load_denoiser(torch.float32)
    ours = spec.load_denoiser_with_lora(tmp_path)
    comfy = spec.load_denoiser_with_lora(tmp_path, COMFYUI_LORA)
    x = (torch.randn(1, 16, 1, 8, 8, generator=g), torch.tensor([0.5]),
         torch.randn(1, 512, 32, generator=g), torch.ones(1, 512, dtype=torch.long),
         torch.randint(1, 100, (1, 512), generator=g), torch.ones(1, 512, dtype=torch.long))
    from dpipe.models.sync_free import carrier

    inputs = (*x, carrier(1, 4, 4, 0))
    with torch.no_grad():
        a, b, c = (spec.denoiser_forward(m, inputs) for m in (base, ours, comfy))
    assert (a - b).abs().max() > 1e-4
    torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
