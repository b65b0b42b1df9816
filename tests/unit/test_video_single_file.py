"""Single-file transformers of the video families (HunyuanVideo, HunyuanVideo 1.5, LTX-Video, LTX-2,
Cosmos-Predict2) in
the layout users download: each tiny transformer written under its original names (the inverse of
diffusers' converter), loaded through the spec with model.single_file_config naming the diffusers
folder, gives exactly the folder's weights; the wrong family's file fails naming the file."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from dpipe.config.schema import ModelConfig
from dpipe.errors import ConfigError, ModelLoadError
from dpipe.models.registry import build_spec
from tests.unit.video_checks import assert_same_tensors
from tests.exports import export_lora

FAMILIES = ("hunyuan_video", "ltx_video", "cosmos_predict2")
# With LTX-2 and LTX-2.3, whose files diffusers 0.42.1 does not tell from LTX-Video's (its
# detection checks LTX-Video's keys first), so the detection test leaves them out; and HunyuanVideo 1.5, which
# diffusers has no single-file support for at all.
LOADED = (*FAMILIES, "ltx2", "ltx23", "hunyuan_video15")
# Keys of the files' other components (VAE, audio VAE, vocoder) and NVIDIA's buffers.
OTHERS = ("vae.", "audio_vae.", "vocoder.", "net.pos_embedder", "net.accum")


def _factories():
    from dpipe.models.cosmos_predict2 import tiny as cosmos
    from dpipe.models.hunyuan_video import tiny as hunyuan
    from dpipe.models.hunyuan_video.hunyuan_video15 import tiny as hunyuan15
    from dpipe.models.ltx_video.ltx2 import ltx23_tiny as ltx23
    from dpipe.models.ltx_video.ltx2 import tiny as ltx2
    from dpipe.models.ltx_video import tiny as ltx

    return {
        "hunyuan_video": (hunyuan.make_tiny_hunyuan_video, hunyuan.write_single_file,
                          "hunyuan_video_720_cfgdistill_bf16.safetensors"),
        "ltx_video": (ltx.make_tiny_ltx_video, ltx.write_single_file,
                      "ltx-video-2b-v0.9.5.safetensors"),
        "cosmos_predict2": (cosmos.make_tiny_cosmos_predict2, cosmos.write_single_file,
                            "cosmos_predict2_2B_t2i.safetensors"),
        "ltx2": (ltx2.make_tiny_ltx2, ltx2.write_single_file, "ltx-2-19b-dev.safetensors"),
        "ltx23": (ltx23.make_tiny_ltx23, ltx2.write_single_file, "ltx-2.3-22b-dev.safetensors"),
        "hunyuan_video15": (hunyuan15.make_tiny_hunyuan_video15, hunyuan15.write_single_file,
                            "hunyuanvideo1.5_720p_t2v_fp16.safetensors"),
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    names = {"cosmos_predict2": "tiny-cosmos_predict2_text2image"}
    return {f: _factories()[f][0](root / names.get(f, f)) for f in LOADED}


@pytest.fixture(scope="module")
def files(folders, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("single")
    return {f: _factories()[f][1](folders[f], out / _factories()[f][2]) for f in LOADED}


def _spec(family: str, path: Path, **values):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": family, "path": str(path), "max_text_tokens": 16, **values}))
    return build_spec(cfg)


def _assert_loads_as_folder(family: str, folder: Path, file: Path,
                            dtype: torch.dtype = torch.float32) -> None:
    spec = _spec(family, file, single_file_config=str(folder))
    spec.ensure_available()
    assert spec.path == folder and spec.single_file == file
    assert_same_tensors(spec.load_denoiser(dtype), _spec(family, folder).load_denoiser(dtype))


def _keys(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(file, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tiny_file_is_in_the_layout_diffusers_recognises(files, family):
    """diffusers identifies each family's original checkpoints by key names
    (`infer_diffusers_model_type`); the tiny files are recognised as the same models, and none
    holds a diffusers name the converter would not have to map."""
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    keys = _keys(files[family])
    kind = infer_diffusers_model_type(keys)
    assert kind.startswith({"hunyuan_video": "hunyuan-video", "ltx_video": "ltx-video",
                            "cosmos_predict2": "cosmos-2.0-t2i"}[family]), kind
    if family == "hunyuan_video":
        assert "double_blocks.0.img_attn_qkv.weight" in keys
        assert "single_blocks.1.linear1.weight" in keys
        assert not any(k.startswith("transformer_blocks.") for k in keys)
    elif family == "ltx_video":
        assert "model.diffusion_model.patchify_proj.weight" in keys
        assert "model.diffusion_model.transformer_blocks.0.attn1.q_norm.weight" in keys
        assert any(k.startswith("vae.") for k in keys)
    else:
        assert "net.blocks.0.self_attn.q_proj.weight" in keys
        assert "net.pos_embedder.dim_spatial_range" in keys
    assert all(v.dtype == torch.bfloat16 for k, v in keys.items()
               if not k.startswith(("vae.", "net.pos_embedder", "net.accum")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", LOADED)
def test_single_file_loads_as_the_folder(folders, files, family, dtype):
    """Every parameter and buffer, computed ones (rotary frequencies) included, in the dtype and
    with the values from_pretrained gives the folder's."""
    _assert_loads_as_folder(family, folders[family], files[family], dtype)


@pytest.mark.parametrize("family", LOADED)
def test_its_gguf_is_read_kept_quantized(folders, files, tmp_path, family):
    from tests.unit.test_gguf_files import assert_gguf_keeps_the_values

    assert_gguf_keeps_the_values(
        lambda path: _spec(family, path, single_file_config=str(folders[family])),
        files[family], tmp_path)


@pytest.mark.parametrize("family,prefix", [
    ("hunyuan_video", "model.diffusion_model."), ("ltx_video", ""),
    ("cosmos_predict2", ""), ("cosmos_predict2", "model.diffusion_model."), ("ltx2", ""),
    ("hunyuan_video15", "model.diffusion_model."), ("hunyuan_video15", "diffusion_model.")])
def test_other_prefixes_load_too(folders, tmp_path, family, prefix):
    """ComfyUI saves models behind `model.diffusion_model.`; downloads come with or without it
    (and Cosmos files with or without NVIDIA's `net.`)."""
    _, write, name = _factories()[family]
    file = write(folders[family], tmp_path / name, prefix=prefix)
    _assert_loads_as_folder(family, folders[family], file)


def test_cosmos_loads_from_nvidia_pt_checkpoint(folders, tmp_path):
    from dpipe.models.cosmos_predict2.tiny import write_single_file

    file = write_single_file(folders["cosmos_predict2"], tmp_path / "model.pt")
    _assert_loads_as_folder("cosmos_predict2", folders["cosmos_predict2"], file)


@pytest.mark.parametrize("family,other", [
    ("hunyuan_video", "ltx_video"), ("ltx_video", "cosmos_predict2"),
    ("cosmos_predict2", "hunyuan_video"), ("hunyuan_video", "cosmos_predict2"),
    ("ltx2", "ltx_video"), ("ltx_video", "ltx2"),
    # HunyuanVideo 1.0 and 1.5 share most original names (double_blocks, txt_in, final_layer).
    ("hunyuan_video15", "hunyuan_video"), ("hunyuan_video", "hunyuan_video15"),
    ("hunyuan_video15", "ltx_video")])
def test_a_file_of_another_family_fails_naming_it(folders, files, family, other):
    spec = _spec(family, files[other], single_file_config=str(folders[family]))
    spec.ensure_available()
    with pytest.raises(ModelLoadError) as err:
        spec.load_denoiser(torch.float32)
    assert str(files[other]) in str(err.value)
    assert "layout dpipe reads" in str(err.value)


@pytest.mark.parametrize("family", LOADED)
def test_single_file_config_errors(folders, files, tmp_path, family):
    with pytest.raises(ConfigError, match="single_file_config"):
        _spec(family, files[family])  # a file alone: where do the VAE and text encoder come from?
    with pytest.raises(ConfigError, match="single_file_config is only used"):
        _spec(family, folders[family], single_file_config=str(folders[family]))
    missing = _spec(family, tmp_path / "missing.safetensors", single_file_config=str(folders[family]))
    with pytest.raises(ModelLoadError, match="missing.safetensors does not exist"):
        missing.ensure_available()


def test_hunyuan_video15_file_holds_tencents_names(folders, files):
    """The tiny file is in the fused form ComfyUI loads (Comfy-Org's repackaged files): q, k, v
    stacked in `img_attn_qkv` / `txt_attn_qkv` (q first), none apart; every other name is that of
    diffusers' conversion script (convert_hunyuan_video1_5_to_diffusers.py): the token refiner's
    fused qkv, the ByT5 mapper, SigLIP projection, condition-type embedding and final layer; no
    diffusers name."""
    from safetensors.torch import load_file

    keys = _keys(files["hunyuan_video15"])
    for key in ("double_blocks.0.img_attn_qkv.weight", "double_blocks.3.txt_attn_qkv.bias",
                "double_blocks.0.img_attn_q_norm.weight", "double_blocks.1.txt_mlp.fc2.weight",
                "double_blocks.2.img_mod.linear.weight", "double_blocks.2.img_attn_proj.weight",
                "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight",
                "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.bias",
                "txt_in.t_embedder.mlp.0.weight", "txt_in.c_embedder.linear_2.bias",
                "byt5_in.layernorm.weight", "byt5_in.fc3.weight", "vision_in.proj.4.bias",
                "cond_type_embedding.weight", "img_in.proj.weight", "time_in.mlp.2.weight",
                "final_layer.adaLN_modulation.1.weight", "final_layer.linear.bias"):
        assert key in keys, key
    assert not any(k.endswith(("_attn_q.weight", "_attn_k.bias", "_attn_v.weight")) for k in keys)
    assert keys["txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"].shape[0] == 3 * 32
    assert not any(k.startswith(("transformer_blocks.", "context_embedder", "x_embedder"))
                   for k in keys)
    folder = {}
    for shard in (folders["hunyuan_video15"] / "transformer").glob("*.safetensors"):
        folder.update(load_file(shard))
    for stream, names in (("img", ("to_q", "to_k", "to_v")),
                          ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"))):
        qkv = torch.cat([folder[f"transformer_blocks.1.attn.{n}.weight"] for n in names])
        assert torch.equal(keys[f"double_blocks.1.{stream}_attn_qkv.weight"], qkv), stream


def test_hunyuan_video15_split_file_loads_too(folders, tmp_path):
    """Tencent's release keeps q, k, v apart (`img_attn_q/_k/_v`): such a file loads as the
    folder, and a fine-tune of it is exported in that form (the export test)."""
    from dpipe.models.hunyuan_video.hunyuan_video15.tiny import write_single_file

    file = write_single_file(folders["hunyuan_video15"], tmp_path / "split.safetensors",
                             form="split")
    keys = _keys(file)
    assert "double_blocks.0.img_attn_q.weight" in keys and "double_blocks.0.txt_attn_v.bias" in keys
    assert not any("_attn_qkv" in k and k.startswith("double_blocks.") for k in keys)
    _assert_loads_as_folder("hunyuan_video15", folders["hunyuan_video15"], file)


def test_hunyuan_video15_final_modulation_is_swapped(folders, files):
    """Tencent's final layer emits (shift, scale), diffusers' norm_out (scale, shift)."""
    from safetensors.torch import load_file

    folder = {}
    for shard in (folders["hunyuan_video15"] / "transformer").glob("*.safetensors"):
        folder.update(load_file(shard))
    scale, shift = folder["norm_out.linear.weight"].chunk(2)
    assert torch.equal(_keys(files["hunyuan_video15"])["final_layer.adaLN_modulation.1.weight"],
                       torch.cat([shift, scale]))


def test_hunyuan_video15_refiner_split_takes_the_model_sizes(folders, files, tmp_path):
    """A refiner qkv of another width (another model's file) fails naming the weight and the
    sizes, not with a shape error deep in load_state_dict."""
    from safetensors.torch import save_file

    tensors = _keys(files["hunyuan_video15"])
    key = "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"
    tensors[key] = torch.cat([tensors[key], tensors[key][:3]])
    bad = tmp_path / "hunyuanvideo1.5_720p_t2v_fp16.safetensors"
    save_file(tensors, bad)
    spec = _spec("hunyuan_video15", bad, single_file_config=str(folders["hunyuan_video15"]))
    with pytest.raises(ModelLoadError, match=r"self_attn_qkv.weight has 99 rows.*96"):
        spec.load_denoiser(torch.float32)


@pytest.mark.parametrize("family", (*LOADED, "hunyuan_video15-split"))
def test_full_export_of_a_single_file_model_writes_that_layout_too(folders, files, tmp_path,
                                                                   family):
    """A full fine-tune trained from a single file is exported as the diffusers folder and as a
    file laid out as the source (same keys, prefixes and dtypes; LTX's VAE / NVIDIA's buffers
    kept), which loads back as the trained weights. The source is someone's fine-tune, so what
    training leaves alone (LTX-2's top-level audio modules) must come from it, not the folder."""
    from safetensors.torch import save_file

    (tmp_path / "source").mkdir()
    family, _, form = family.partition("-")  # HunyuanVideo 1.5 from Tencent's split file too
    if form:
        files = {family: _factories()[family][1](folders[family], tmp_path / files[family].name,
                                                  form=form)}
    source_file = _fine_tune(files[family], tmp_path / "source" / files[family].name)
    spec = _spec(family, source_file, single_file_config=str(folders[family]), mode="full")
    spec.ensure_available()
    denoiser = spec.load_denoiser(torch.float32)
    base = {k: v.clone() for k, v in denoiser.state_dict().items()}
    with torch.no_grad():
        for param in denoiser.parameters():
            param.add_(0.01 * torch.randn_like(param))  # "trained"
    weights = {}
    for layer in spec.pipeline_layers(denoiser):
        weights.update(layer.denoiser_state_dict(trainable_only=False))
    # What the layers hold is trained; the rest (LTX-2's top-level audio modules) stays the base's.
    trained = {k: v if k in weights else base[k] for k, v in denoiser.state_dict().items()}
    shard = tmp_path / "stage-0.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, shard)
    out = tmp_path / "model"
    spec.export_full([shard], out)

    exported, source = out / files[family].name, _keys(source_file)
    got = _keys(exported)
    assert _header(exported) == _header(source_file) == RELEASE_HEADER
    assert list(got) == list(source)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in source.items()}
    changed = [k for k in source if not torch.equal(got[k], source[k])]
    kept = [k for k in source if k.startswith(OTHERS)]
    assert changed and not set(kept) & set(changed)
    reloaded = _spec(family, exported, single_file_config=str(folders[family]))
    reloaded.ensure_available()
    back = reloaded.load_denoiser(torch.float32).state_dict()
    for name, value in trained.items():
        assert torch.equal(back[name], value.to(torch.bfloat16).float()), name
    folder = spec.load_exported_full(out).state_dict()
    for name, value in trained.items():
        torch.testing.assert_close(folder[name], value)


# A released file's header: Lightricks' LTX-2 files carry the model's config, from which ComfyUI
# builds the transformer (LTX-2.3's gated attention, ...) and the VAE (comfy/model_detection.py,
# ComfyUI 783545f6); an export without it loads there as another model.
RELEASE_HEADER = {"format": "pt", "config": json.dumps({"transformer": {
    "apply_gated_attention": True, "caption_proj_before_connector": True}})}


def _fine_tune(file: Path, out: Path) -> Path:
    """`file` with every transformer weight changed: someone's fine-tune in the same layout, with
    a released file's header."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {k: v if k.startswith(OTHERS) else
               (v.float() + 0.05 * torch.randn(v.shape, generator=generator)).to(v.dtype)
               for k, v in _keys(file).items()}
    save_file(tensors, out, metadata=RELEASE_HEADER)
    return out


def _header(file: Path) -> dict[str, str]:
    with safe_open(file, "pt") as f:
        return f.metadata()


@pytest.mark.parametrize("family", LOADED)
def test_exported_lora_loads_onto_the_single_file_transformer(folders, files, tmp_path, family):
    """`load_denoiser_with_lora` (the diffusers way of loading the LoRA) puts it on the single
    file's transformer, not the folder's: with a fine-tuned file, it reproduces the LoRA model."""
    from tests.unit.video_checks import lora_denoiser, lora_state_dict, micro_batch

    file = _fine_tune(files[family], tmp_path / files[family].name)
    spec = _spec(family, file, single_file_config=str(folders[family]), lora={"rank": 4, "alpha": 8})
    spec.ensure_available()
    denoiser = lora_denoiser(spec)
    out = tmp_path / "lora"
    out.mkdir()
    export_lora(spec, lora_state_dict(denoiser), out)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    frames = {"cosmos_predict2": 1, "ltx_video": 9, "ltx2": 9, "ltx23": 9}.get(family, 5)  # Text2Image: images only
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, frames, 64, 64) * 2 - 1)
    with torch.no_grad():
        expected = spec.denoiser_forward(denoiser, inputs)
        loaded = spec.denoiser_forward(spec.load_denoiser_with_lora(out), inputs)
        on_folder = _spec(family, folders[family]).load_denoiser_with_lora(out)
        other = spec.denoiser_forward(on_folder, inputs)
    torch.testing.assert_close(loaded, expected, rtol=1e-4, atol=1e-5)
    assert (other - expected).abs().max() > 1e-3


def test_ltx2_file_has_the_keys_diffusers_reads_as_ltx2(files):
    """The key diffusers identifies LTX-2 checkpoints by, and the original names of its
    audio-video modules; the stand-in VAE / audio VAE / vocoder keys are skipped on loading."""
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES

    keys = _keys(files["ltx2"])
    assert CHECKPOINT_KEY_NAMES["ltx2"][0] in keys
    assert "model.diffusion_model.audio_patchify_proj.weight" in keys
    assert "model.diffusion_model.transformer_blocks.0.scale_shift_table_a2v_ca_video" in keys
    assert not any("norm_q" in k or "time_embed" in k for k in keys)
    assert any(k.startswith("audio_vae.") for k in keys)
