"""The tiny OmniGen2: dpipe's transformer has the reference's keys, shapes and config fields; the
layers reproduce its forward; the LoRA, ComfyUI and full exports reload; bad folders are refused."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpipe.errors import ModelLoadError
from dpipe.models.comfyui import apply_comfy_lora
from dpipe.models.omnigen2.sizes import OMNIGEN2_4B, OMNIGEN2_TINY
from dpipe.models.omnigen2.spec import COMFY_LORA, OmniGen2Spec
from dpipe.models.omnigen2.transformer import OmniGen2Transformer2DModel
from tests.unit.video_checks import (
    assert_layers_match_each_item_alone, noised_images, tiny_spec)
from tests.exports import export_lora

CAPTIONS = ["a red circle on a blue background", "a cat",
            "A photo of two green stars, a painting of a dog in the park, an illustration"]


def reference_keys(c: dict) -> dict[str, tuple[int, ...]]:
    """The state dict of the reference's OmniGen2Transformer2DModel (VectorSpaceLab/OmniGen2
    omnigen2/models/transformers/transformer_omnigen2.py and block_lumina2.py, commit 0f72fa9)
    for config `c`: written from reading that code, independently of dpipe's module."""
    d, p = c["hidden_size"], c["patch_size"]
    out_c = c["out_channels"] or c["in_channels"]
    hd = d // c["num_attention_heads"]
    kv = c["num_kv_heads"] * hd
    inner = 4 * d
    if c["ffn_dim_multiplier"] is not None:
        inner = int(c["ffn_dim_multiplier"] * inner)
    inner = c["multiple_of"] * math.ceil(inner / c["multiple_of"])
    cond = min(d, 1024)
    t = c["text_feat_dim"]
    keys = {
        "x_embedder.weight": (d, p * p * c["in_channels"]), "x_embedder.bias": (d,),
        "ref_image_patch_embedder.weight": (d, p * p * c["in_channels"]),
        "ref_image_patch_embedder.bias": (d,),
        "time_caption_embed.timestep_embedder.linear_1.weight": (cond, 256),
        "time_caption_embed.timestep_embedder.linear_1.bias": (cond,),
        "time_caption_embed.timestep_embedder.linear_2.weight": (cond, cond),
        "time_caption_embed.timestep_embedder.linear_2.bias": (cond,),
        "time_caption_embed.caption_embedder.0.weight": (t,),
        "time_caption_embed.caption_embedder.1.weight": (d, t),
        "time_caption_embed.caption_embedder.1.bias": (d,),
        "norm_out.linear_1.weight": (d, cond), "norm_out.linear_1.bias": (d,),
        "norm_out.linear_2.weight": (p * p * out_c, d), "norm_out.linear_2.bias": (p * p * out_c,),
        "image_index_embedding": (5, d),
    }

    def block(prefix: str, modulation: bool):
        keys.update({
            f"{prefix}.attn.to_q.weight": (d, d), f"{prefix}.attn.to_k.weight": (kv, d),
            f"{prefix}.attn.to_v.weight": (kv, d), f"{prefix}.attn.to_out.0.weight": (d, d),
            f"{prefix}.attn.norm_q.weight": (hd,), f"{prefix}.attn.norm_k.weight": (hd,),
            f"{prefix}.feed_forward.linear_1.weight": (inner, d),
            f"{prefix}.feed_forward.linear_2.weight": (d, inner),
            f"{prefix}.feed_forward.linear_3.weight": (inner, d),
            f"{prefix}.ffn_norm1.weight": (d,), f"{prefix}.norm2.weight": (d,),
            f"{prefix}.ffn_norm2.weight": (d,),
        })
        if modulation:
            keys.update({f"{prefix}.norm1.linear.weight": (4 * d, cond),
                         f"{prefix}.norm1.linear.bias": (4 * d,),
                         f"{prefix}.norm1.norm.weight": (d,)})
        else:
            keys[f"{prefix}.norm1.weight"] = (d,)

    for i in range(c["num_refiner_layers"]):
        block(f"noise_refiner.{i}", True)
        block(f"ref_image_refiner.{i}", True)
        block(f"context_refiner.{i}", False)
    for i in range(c["num_layers"]):
        block(f"layers.{i}", True)
    return keys


# The reference's __init__ arguments (its config.json fields besides _class_name and
# _diffusers_version).
REFERENCE_FIELDS = {"patch_size", "in_channels", "out_channels", "hidden_size", "num_layers",
                    "num_refiner_layers", "num_attention_heads", "num_kv_heads", "multiple_of",
                    "ffn_dim_multiplier", "norm_eps", "axes_dim_rope", "axes_lens",
                    "text_feat_dim", "timestep_scale"}


def _spec(path: Path, **values) -> OmniGen2Spec:
    return tiny_spec(path, "omnigen2", max_text_tokens=64, **values)


def test_keys_shapes_and_config_equal_the_reference(tiny):
    model = OmniGen2Transformer2DModel.from_pretrained(tiny, subfolder="transformer")
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == reference_keys(OMNIGEN2_TINY)
    config = json.loads((tiny / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "OmniGen2Transformer2DModel"
    assert set(config) - {"_class_name", "_diffusers_version"} == REFERENCE_FIELDS
    assert set(OMNIGEN2_4B) - {"_class_name"} == REFERENCE_FIELDS


def test_real_size_has_the_published_parameter_count():
    """OmniGen2's transformer: about 4B parameters (3.97B by the reference's table)."""
    total = sum(math.prod(s) for s in reference_keys(OMNIGEN2_4B).values())
    with torch.device("meta"):
        model = OmniGen2Transformer2DModel(
            **{k: v for k, v in OMNIGEN2_4B.items() if k != "_class_name"})
    assert sum(p.numel() for p in model.parameters()) == total
    assert 3.9e9 < total < 4.1e9


def test_mllm_width_is_the_transformers_text_width(tiny):
    from transformers import Qwen2_5_VLForConditionalGeneration

    mllm = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny / "mllm")
    assert mllm.config.text_config.hidden_size == OMNIGEN2_TINY["text_feat_dim"]


def _inputs(spec, encoders, captions, seed=0):
    return spec.make_inputs(noised_images(spec, encoders, captions, seed))


def test_prompts_as_the_reference_pipeline(tiny):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    chat = spec.chat(encoders.tokenizer, "a cat")
    assert chat.startswith("<|im_start|>system\nYou are a helpful assistant that generates "
                           "high-quality images based on user instructions.<|im_end|>\n"
                           "<|im_start|>user\na cat<|im_end|>")
    text = spec.encode_prompts(encoders, CAPTIONS[:2])
    # Right padding to max_text_tokens gives the real tokens' states of the reference's
    # padding to the longest prompt.
    alone = spec.encode_prompts(encoders, CAPTIONS[1:2])
    n = int(alone["cap_mask"].sum())
    torch.testing.assert_close(text["cap"][1, :n], alone["cap"][0, :n])
    assert text["cap_mask"][1, :n].all() and not text["cap_mask"][1, n:].any()


def test_layers_match_the_forward_for_captions_of_any_length(tiny):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, (target,) = _inputs(spec, encoders, CAPTIONS)
    assert len(set(inputs[3].tolist())) == 3
    denoiser = spec.load_denoiser(torch.float32)
    assert_layers_match_each_item_alone(spec, denoiser, inputs, target)
    assert len(spec.pipeline_layers(denoiser)) == spec.pipeline_layer_count()


def test_blocks_run_lumina2_with_omnigen2_positions(tiny):
    """For one caption the forward is diffusers' Lumina2Transformer2DModel on the same weights,
    but for the two published differences: t scaled by timestep_scale, and caption tokens at
    RoPE (i, i, i), not (i, 0, 0). With one RoPE axis (the other two of zero width) those agree."""
    from diffusers import Lumina2Transformer2DModel

    config = {**{k: v for k, v in OMNIGEN2_TINY.items() if k != "_class_name"},
              "axes_dim_rope": [24, 0, 0], "timestep_scale": 1.0}
    torch.manual_seed(0)
    ours = OmniGen2Transformer2DModel(**config).eval()
    lumina = Lumina2Transformer2DModel(
        patch_size=2, in_channels=config["in_channels"], hidden_size=config["hidden_size"],
        num_layers=config["num_layers"], num_refiner_layers=config["num_refiner_layers"],
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, norm_eps=1e-5,
        axes_dim_rope=(24, 0, 0), axes_lens=(1024, 64, 64), cap_feat_dim=config["text_feat_dim"],
        scaling_factor=1.0).eval()
    state = {k: v for k, v in ours.state_dict().items()
             if not k.startswith(("ref_image", "image_index"))}
    lumina.load_state_dict(state, strict=True)
    g = torch.Generator().manual_seed(1)
    latents, cap = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 9, 32, generator=g)
    t, mask = torch.tensor([0.3]), torch.ones(1, 9, dtype=torch.bool)
    with torch.no_grad():
        expected = lumina(latents, t, cap, mask, return_dict=False)[0]
        got = ours(latents, t, cap, mask)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_lora_and_comfyui_exports_reload(tiny, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict

    spec = _spec(tiny, lora={"rank": 4, "alpha": 8})
    denoiser = spec.load_denoiser(torch.float32)
    denoiser.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=spec.lora_targets(),
                                    init_lora_weights=False))
    state = get_peft_model_state_dict(denoiser)
    assert not any("ref_image" in k for k in state)
    files = export_lora(spec, state, tmp_path)
    assert [f.name for f in files] == ["pytorch_lora_weights.safetensors", COMFY_LORA]
    assert all(k.startswith("transformer.") for k in load_file(files[0]))
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, _ = _inputs(spec, encoders, CAPTIONS[:2])
    with torch.no_grad():
        trained = spec.denoiser_forward(denoiser, inputs)
        reloaded = spec.denoiser_forward(spec.load_denoiser_with_lora(tmp_path), inputs)
        base_model = spec.load_denoiser(torch.float32)
        base = spec.denoiser_forward(base_model, inputs)
        merged = apply_comfy_lora(base_model.state_dict(), load_file(tmp_path / COMFY_LORA))
        base_model.load_state_dict(merged)
        comfy = spec.denoiser_forward(base_model, inputs)
    assert (trained - base).abs().max() > 1e-3
    torch.testing.assert_close(reloaded, trained, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comfy, trained, rtol=1e-4, atol=1e-5)


def test_full_export_keeps_the_reference_image_weights(tiny, tmp_path):
    from dpipe.train.export import write_stage_shard

    spec = _spec(tiny)
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    with torch.no_grad():
        for p in denoiser.layers[0].parameters():
            p.add_(0.01)
    shards = [tmp_path / "stage-000.safetensors", tmp_path / "stage-001.safetensors"]
    write_stage_shard(layers[:3], False, shards[0])
    write_stage_shard(layers[3:], False, shards[1])
    spec.export_full(shards, tmp_path / "model")
    exported = spec.load_exported_full(tmp_path / "model")
    base = spec.load_denoiser(torch.float32).state_dict()
    for key, value in exported.state_dict().items():
        if key.startswith(("ref_image", "image_index")):
            assert torch.equal(value, base[key]), key
        else:
            assert torch.equal(value, denoiser.state_dict()[key]), key
    config = json.loads((tmp_path / "model" / "transformer" / "config.json").read_text())
    assert config == json.loads((tiny / "transformer" / "config.json").read_text())


def test_another_familys_folder_is_refused(tmp_path, tiny):
    import shutil

    other = tmp_path / "lumina"
    shutil.copytree(tiny, other)
    config = other / "transformer" / "config.json"
    config.write_text(json.dumps({"_class_name": "Lumina2Transformer2DModel"}))
    with pytest.raises(ModelLoadError, match=r"transformer/config.json names "
                                             r"'Lumina2Transformer2DModel'"):
        _spec(other).ensure_available()
    shutil.rmtree(other / "mllm")
    with pytest.raises(ModelLoadError, match="missing mllm"):
        _spec(other).ensure_available()


def test_schedule_is_the_reference_schedulers(tiny):
    spec = _spec(tiny)
    sampling = spec.sampling()
    scheduler = sampling.new_scheduler()
    latents = torch.zeros(1, 4, 128, 128)  # 1024x1024: m = 3.2
    t = scheduler.set_timesteps(4, latents)
    m = 3.2
    base = torch.tensor([0.0, 0.25, 0.5, 0.75], dtype=torch.float64)
    torch.testing.assert_close(t, (base / (m - m * base + base)).float())
    assert sampling.training_shift(latents) == pytest.approx(3.2)
    # Euler from t to the next t, the last step to t = 1.
    x = torch.zeros(1, 4, 2, 2)
    for i, ti in enumerate(t):
        x = scheduler.step(torch.ones_like(x), ti, x)[0]
    torch.testing.assert_close(x, torch.ones_like(x))
