"""The checks every family's tiny model passes, run for each tiny model config
(`conf/model/tiny_*.yaml`) from what the family declares: its tiny folder is made once and is the
same everywhere and holds the release's parts and files (RELEASES), every denoiser parameter sits in
exactly one pipeline layer, the LoRA reaches every block, and the folder loads in the declared
diffusers pipeline and generates. A new family gets these by declaring; the `test_tiny_<family>.py`
modules keep what is the family's own (a pipeline that needs parts given, as OWN_LOADING lists;
prompts, latents and layers against the pipeline's)."""

from __future__ import annotations

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.unit.video_checks import TINY_CONFIGS, tiny_config_spec

# Denoiser parameters that no pipeline layer holds, by design: parts of the checkpoint a run of the
# tiny config never uses (so they stay frozen and out of the stages' memory).
NOT_IN_LAYERS = {
    # the sound stream and its cross-attention to video: in the layers with model.audio=true
    "tiny_ltx2": ("audio_", "av_cross_attn_"),
    "tiny_ltx23": ("audio_", "av_cross_attn_"),
    "tiny_omnigen2": ("ref_image_", "image_index_embedding"),  # edits: OmniGen2 trains text to image
}
# Blocks whose LoRA targets leave some out, by design: SDXL adapts the UNet's attention
# transformers, and its first down block and last up block have none.
PARTLY_ADAPTED = {"tiny_sdxl"}
# Linears of the blocks left without LoRA, by design: LTX-2's sound stream, adapted with
# model.audio=true.
LORA_LEAVES_OUT = dict.fromkeys(("tiny_ltx2", "tiny_ltx23"), ("audio", "av_cross_attn"))
# Embedding layers that hold LoRA, by design.
ADAPTED_EDGES = {
    "tiny_anima": "its LLM adapter (text_conditioner) trains with the blocks",
    "tiny_hunyuan_image": "its embedding layer runs the first block",
}


def _files(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("config", TINY_CONFIGS)
def test_tiny_model_is_made_once_and_the_same_everywhere(config, tiny_models, tmp_path):
    """A second run finds the folder and leaves it alone; a folder made elsewhere holds the same
    bytes (cache keys hash these files: a tiny model that differed per machine would miss)."""
    spec = tiny_config_spec(tiny_models, config)
    stamps = {p: p.stat().st_mtime_ns for p in spec.path.rglob("*")}
    spec.ensure_available()
    assert {p: p.stat().st_mtime_ns for p in spec.path.rglob("*")} == stamps
    again = tiny_config_spec(tmp_path, config)
    assert _files(again.path) == _files(spec.path)


@pytest.mark.parametrize("config", TINY_CONFIGS)
def test_every_denoiser_parameter_is_in_exactly_one_pipeline_layer(config, tiny_models):
    spec = tiny_config_spec(tiny_models, config)
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    assert spec.pipeline_layer_count() in (None, len(layers))
    held = Counter(n for layer in layers for n, _ in layer.source_named_parameters())
    assert {n for n, count in held.items() if count > 1} == set()
    unused = NOT_IN_LAYERS.get(config, ())
    expected = {n for n, _ in denoiser.named_parameters() if not n.startswith(unused)}
    assert set(held) == expected


def _linears(module: torch.nn.Module) -> dict[str, bool]:
    """Each Linear of `module` by name: whether it carries a LoRA adapter."""
    found = {}
    for name, sub in module.named_modules():
        if hasattr(sub, "base_layer") and hasattr(sub, "lora_A"):
            found[name] = True
        elif isinstance(sub, torch.nn.Linear) and \
                not {"base_layer", "lora_A", "lora_B"} & set(name.split(".")):
            found[name] = False
    return found


@pytest.mark.parametrize("config", TINY_CONFIGS)
def test_lora_reaches_every_block(config, tiny_models):
    """The default targets put an adapter on every Linear of every layer between the embedding
    and the head (a regex that missed one kind of block, or one projection, would train only the
    others, silently), none in the embedding and the head, and train nothing else."""
    from tests.unit.video_checks import lora_denoiser

    spec = tiny_config_spec(tiny_models, config)
    denoiser = lora_denoiser(spec)
    layers = spec.pipeline_layers(denoiser)
    blocks = [found for found in map(_linears, layers[1:-1]) if found]  # joins hold no Linear
    assert blocks
    if config in PARTLY_ADAPTED:
        assert sum(any(found.values()) for found in blocks) >= len(blocks) / 2
    else:
        left_out = LORA_LEAVES_OUT.get(config, ())
        missing = [f"{i}: {name}" for i, found in enumerate(blocks) for name, adapted in
                   found.items() if not adapted and not any(part in name for part in left_out)]
        assert not missing, f"block Linears without LoRA: {missing}"
    if config not in ADAPTED_EDGES:
        edges = {**_linears(layers[0]), **_linears(layers[-1])}
        assert not [name for name, adapted in edges.items() if adapted]
    trainable = {n for n, p in denoiser.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


# What each release's folder holds, as the tiny folder must hold it too: model_index.json's values
# for the parts named (each [library, class], as diffusers reads them) and the files beside it
# (tokenizer files, weights sharded with their index where the release shards them).
FLOW = {"scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
RELEASES = {
    "tiny_auraflow": ({
        "_class_name": "AuraFlowPipeline", "tokenizer": ["transformers", "LlamaTokenizerFast"],
        "text_encoder": ["transformers", "UMT5EncoderModel"]}, [
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors"]),
    "tiny_chroma": ({
        **FLOW, "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "ChromaTransformer2DModel"]}, [
        "tokenizer/tokenizer.json", "text_encoder/model.safetensors.index.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"]),
    "tiny_ernie_image": ({
        **FLOW, "vae": ["diffusers", "AutoencoderKLFlux2"],
        "text_encoder": ["transformers", "Mistral3Model"],
        "tokenizer": ["transformers", "TokenizersBackend"],
        "transformer": ["diffusers", "ErnieImageTransformer2DModel"]}, [
        "tokenizer/tokenizer.json", "scheduler/scheduler_config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/model.safetensors", "vae/diffusion_pytorch_model.safetensors"]),
    # the same files as black-forest-labs/FLUX.1-dev: CLIP vocab/merges, sharded weights
    "tiny_flux": ({
        **FLOW, "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"]}, [
        "tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer_2/tokenizer.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        *(f"transformer/diffusion_pytorch_model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)),
        "text_encoder_2/model.safetensors.index.json", "text_encoder/model.safetensors",
        "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"]),
    "tiny_flux2": ({
        "_class_name": "Flux2Pipeline", "tokenizer": ["transformers", "PixtralProcessor"],
        "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"]}, [
        "tokenizer/tokenizer.json", "tokenizer/chat_template.jinja",
        "tokenizer/processor_config.json", "tokenizer/preprocessor_config.json",
        "text_encoder/model.safetensors.index.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"]),
    "tiny_hunyuan_video": ({
        "_class_name": "HunyuanVideoPipeline", "tokenizer": ["transformers", "LlamaTokenizerFast"],
        "text_encoder": ["transformers", "LlamaModel"]}, [
        "tokenizer/tokenizer.json", "tokenizer_2/vocab.json", "tokenizer_2/merges.txt",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/model.safetensors.index.json", "scheduler/scheduler_config.json",
        "vae/diffusion_pytorch_model.safetensors", "text_encoder_2/model.safetensors"]),
    "tiny_hunyuan_video15": ({
        "_class_name": "HunyuanVideo15Pipeline",
        "text_encoder": ["transformers", "Qwen2_5_VLTextModel"],
        "tokenizer_2": ["transformers", "ByT5Tokenizer"],
        "guider": ["diffusers", "ClassifierFreeGuidance"]}, [
        "tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer/tokenizer_config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/model.safetensors.index.json", "guider/guider_config.json"]),
    "tiny_ideogram4": ({
        "vae": ["diffusers", "AutoencoderKLFlux2"],
        "text_encoder": ["transformers", "Qwen3VLModel"],
        "transformer": ["diffusers", "Ideogram4Transformer2DModel"],
        "unconditional_transformer": ["diffusers", "Ideogram4Transformer2DModel"]}, [
        "tokenizer/tokenizer.json", "scheduler/scheduler_config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "unconditional_transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/model.safetensors.index.json", "vae/diffusion_pytorch_model.safetensors"]),
    "tiny_krea2": ({
        **FLOW, "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "text_encoder": ["transformers", "Qwen3VLModel"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "Krea2Transformer2DModel"], "patch_size": 2}, [
        "tokenizer/tokenizer.json", "scheduler/scheduler_config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/model.safetensors.index.json", "vae/diffusion_pytorch_model.safetensors"]),
    "tiny_ltx2": ({
        "_class_name": "LTX2Pipeline",
        "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"]}, [
        "transformer/diffusion_pytorch_model.safetensors.index.json"]),
    "tiny_ltx_video": ({
        "_class_name": "LTXPipeline", "tokenizer": ["transformers", "T5TokenizerFast"]}, [
        "tokenizer/tokenizer.json", "scheduler/scheduler_config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/model.safetensors.index.json", "vae/diffusion_pytorch_model.safetensors"]),
    "tiny_lumina2": ({
        **FLOW, "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "Gemma2Model"],
        "tokenizer": ["transformers", "GemmaTokenizerFast"],
        "transformer": ["diffusers", "Lumina2Transformer2DModel"]}, [
        "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/model.safetensors.index.json",
        "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"]),
    "tiny_omnigen2": ({
        "_class_name": "OmniGen2Pipeline",
        "mllm": ["transformers", "Qwen2_5_VLForConditionalGeneration"]}, [
        "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors.index.json",
        "mllm/config.json", "mllm/model.safetensors.index.json", "vae/config.json",
        "processor/tokenizer.json", "processor/preprocessor_config.json",
        "scheduler/scheduler_config.json"]),
    "tiny_qwen_image": ({
        **FLOW, "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"]}, [
        "tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer/tokenizer.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/model.safetensors.index.json",
        "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"]),
    "tiny_qwen_image_edit": ({
        "_class_name": "QwenImageEditPipeline",
        "processor": ["transformers", "Qwen2VLProcessor"]}, [
        "processor/preprocessor_config.json", "processor/tokenizer.json",
        "processor/chat_template.jinja", "tokenizer/tokenizer.json"]),
    "tiny_qwen_image_edit_plus": ({
        "_class_name": "QwenImageEditPlusPipeline",
        "processor": ["transformers", "Qwen2VLProcessor"]}, []),
    "tiny_sd3": ({
        **FLOW, "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "tokenizer_3": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "image_encoder": [None, None], "feature_extractor": [None, None]}, [
        "tokenizer/vocab.json", "tokenizer_2/merges.txt", "tokenizer_3/tokenizer.json",
        "text_encoder_3/model.safetensors.index.json", "text_encoder/model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"]),
    "tiny_z_image": ({
        **FLOW, "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "Qwen3Model"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "ZImageTransformer2DModel"]}, [
        "tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer/tokenizer.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/model.safetensors.index.json",
        "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"]),
}


@pytest.mark.parametrize("config", RELEASES)
def test_folder_holds_the_release_parts_and_files(config, tiny_models):
    """The tiny folder is laid out as the release: model_index.json names the release's class for
    each part listed, and the release's files are there."""
    parts, files = RELEASES[config]
    folder = tiny_config_spec(tiny_models, config).path
    index = json.loads((folder / "model_index.json").read_text())
    assert {name: index.get(name) for name in parts} == parts
    assert [rel for rel in files if not (folder / rel).is_file()] == []


# What a pipeline's call needs beyond the prompt, size, steps, seed and (where it takes one) the
# text length, where its defaults do not suit a tiny model: test data, not the family's (dpipe
# samples with its own sampler, not the pipeline's call).
CALL_ARGS = {
    "tiny_ideogram4": {"guidance_schedule": None},  # its default is a schedule of 48 steps
    "tiny_flux_kontext": {"_auto_resize": False, "max_area": 64 * 64},  # else it renders 1 MP
}
# Configs whose folder its pipeline does not load with its defaults alone; their modules load it
# with what it needs. Why, for each:
OWN_LOADING = {
    "tiny_anima": "a modular pipeline (no model_index.json)",
    "tiny_minimax_h3": "a modular pipeline (no model_index.json)",
    "tiny_omnigen2": "no diffusers pipeline runs OmniGen2",
    "tiny_cosmos1": "its pipeline wants cosmos_guardrail's safety checker",
    "tiny_cosmos_predict2": "its pipeline wants cosmos_guardrail's safety checker",
    "tiny_cosmos_predict2_v2w": "its pipeline wants cosmos_guardrail's safety checker",
    "tiny_hidream": "the Llama encoder is given to the pipeline, as for the release",
    "tiny_flux2": "its Pixtral processor is given to the pipeline",
    "tiny_qwen_image_edit": "Qwen2-VL's image processor needs torchvision",
    "tiny_qwen_image_edit_plus": "Qwen2-VL's image processor needs torchvision",
    # image-to-video folders: another pipeline than the family's, and a first frame
    "tiny_wan_i2v": "WanImageToVideoPipeline", "tiny_wan_flf2v": "WanImageToVideoPipeline",
    "tiny_wan22_i2v_a14b": "WanImageToVideoPipeline",
}


def _components(index: dict) -> list[tuple[str, tuple[str, str]]]:
    """model_index.json's parts: name -> (module, class); a pipeline's own module ("ltx2")
    under diffusers.pipelines."""
    return [(name, (lib if lib in ("diffusers", "transformers") else f"diffusers.pipelines.{lib}",
                    cls)) for name, value in index.items()
            if isinstance(value, list) and len(value) == 2 and value[1] is not None
            for lib, cls in [value]]


@pytest.mark.parametrize("config", [c for c in TINY_CONFIGS if c not in OWN_LOADING])
def test_loads_in_its_pipeline_and_generates(config, tiny_models):
    """The folder loads in the declared diffusers pipeline with its defaults, every part as the
    class model_index.json names (the denoiser as declared), and makes a picture (a clip of the
    shortest length the family takes, for video) in 2 steps."""
    import importlib
    import inspect

    import numpy as np
    from PIL import Image

    from dpipe.models.family import diffusers_class

    spec = tiny_config_spec(tiny_models, config)
    index = json.loads((spec.path / "model_index.json").read_text())
    assert index["_class_name"] == spec.pipeline_class.rsplit(":", 1)[-1]
    pipe = diffusers_class(spec.pipeline_class).from_pretrained(spec.path, dtype=torch.float32)
    for name, (library, cls) in _components(index):
        assert isinstance(getattr(pipe, name), getattr(importlib.import_module(library), cls)), name
    assert isinstance(getattr(pipe, spec.denoiser_folder), diffusers_class(spec.denoiser_class))

    sampling = spec.sampling()
    takes = inspect.signature(pipe.__call__).parameters
    args = {"height": 64, "width": 64, "num_inference_steps": 2, "output_type": "np",
            "generator": torch.Generator().manual_seed(0), **CALL_ARGS.get(config, {})}
    if "max_sequence_length" in takes:
        args["max_sequence_length"] = spec.cfg.max_text_tokens
    if "guidance_scale" in takes:  # one denoiser call a step: at 1, classifier-free guidance is off
        args["guidance_scale"] = 1.0
    if sampling.video:
        args["num_frames"] = sampling.frame_step + 1
    if sampling.needs_control:
        args["image"] = Image.new("RGB", (64, 64), (220, 40, 40))
    out = pipe(prompt="a red circle on a blue background", **args)
    pictures = np.asarray(out.frames if sampling.video else out.images)
    frames = (args["num_frames"],) if sampling.video else ()
    assert pictures.shape == (1, *frames, 64, 64, 3)
    assert np.isfinite(pictures).all()
    if getattr(out, "audio", None) is not None:  # the sound of an audio-video pipeline
        assert len(out.audio) == 1 and torch.isfinite(torch.as_tensor(out.audio)).all()


def _writes_its_own(config: str, *methods: str) -> bool:
    """Whether the config's family writes one of `methods` itself instead of the base's."""
    from dpipe.models.family import DiffusersFamily, imported
    from dpipe.models.registry import FAMILIES

    spec = imported(FAMILIES[TINY_CONFIGS[config][0]])
    return any(getattr(spec, m) is not getattr(DiffusersFamily, m) for m in methods)


# The full export where a family writes its own export or layers (the layers decide what the
# stage shards hold), and once on the base's path throughout: every config would cost ~0.4 s each.
FULL_EXPORTS = [c for c in TINY_CONFIGS if c == "tiny_hunyuan_video15" or _writes_its_own(
    c, "export_full", "load_exported_full", "pipeline_layers")]


@pytest.mark.parametrize("config", FULL_EXPORTS)
def test_full_export_loads_as_the_base(config, tiny_models, tmp_path):
    """A full fine-tune's export, from two stages' shards as the pipeline writes them, loads
    back (`load_exported_full`) with every tensor of the base: the parts no layer holds too."""
    from safetensors.torch import save_file

    spec = tiny_config_spec(tiny_models, config)
    base = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(base)
    shards = []
    for stage, part in enumerate((layers[:len(layers) // 2], layers[len(layers) // 2:])):
        state = {k: v for layer in part
                 for k, v in layer.denoiser_state_dict(trainable_only=False).items()}
        shards.append(tmp_path / f"stage-{stage}.safetensors")
        save_file({k: v.contiguous() for k, v in state.items()}, shards[-1])
    spec.export_full(shards, tmp_path / "export")
    loaded = spec.load_exported_full(tmp_path / "export").state_dict()
    want = base.state_dict()
    assert loaded.keys() == want.keys()
    for name, value in want.items():  # a tensor the export lacks loads as meta
        assert not loaded[name].is_meta and torch.equal(loaded[name].float(), value), name
