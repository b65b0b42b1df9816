"""Maps `model.family` names to their `ModelSpec` classes."""

from __future__ import annotations

import importlib

from dpipe.config.schema import ModelConfig
from dpipe.errors import ConfigError
from dpipe.models.spec import ModelSpec

# family name -> "module:Class"; imported lazily so one family's imports never slow another's.
FAMILIES: dict[str, str] = {
    "flux": "dpipe.models.flux.spec:FluxSpec",
    "flux_kontext": "dpipe.models.flux.kontext:FluxKontextSpec",
    "flux2": "dpipe.models.flux2.spec:Flux2Spec",
    "wan": "dpipe.models.wan.spec:WanSpec",
    "cosmos_predict2": "dpipe.models.cosmos_predict2.spec:CosmosPredict2Spec",
    "cosmos1": "dpipe.models.cosmos1.spec:Cosmos1Spec",
    "anima": "dpipe.models.anima.spec:AnimaSpec",
    "hunyuan_video": "dpipe.models.hunyuan_video.spec:HunyuanVideoSpec",
    "ltx_video": "dpipe.models.ltx_video.spec:LTXVideoSpec",
    "hunyuan_video15": "dpipe.models.hunyuan_video.hunyuan_video15.spec:HunyuanVideo15Spec",
    "ltx2": "dpipe.models.ltx_video.ltx2.spec:LTX2Spec",
    "ltx23": "dpipe.models.ltx_video.ltx2.ltx23:LTX23Spec",
    "chroma": "dpipe.models.chroma.spec:ChromaSpec",
    "sd3": "dpipe.models.sd3.spec:SD3Spec",
    "auraflow": "dpipe.models.auraflow.spec:AuraFlowSpec",
    "sdxl": "dpipe.models.sdxl.spec:SDXLSpec",
    "hunyuan_image": "dpipe.models.hunyuan_image.spec:HunyuanImageSpec",
    "hidream": "dpipe.models.hidream.spec:HiDreamSpec",
    "z_image": "dpipe.models.z_image.spec:ZImageSpec",
    "lumina2": "dpipe.models.lumina2.spec:Lumina2Spec",
    "qwen_image": "dpipe.models.qwen_image.spec:QwenImageSpec",
    "qwen_image_edit": "dpipe.models.qwen_image.edit:QwenImageEditSpec",
    "qwen_image_edit_plus": "dpipe.models.qwen_image.edit_plus:QwenImageEditPlusSpec",
    "krea2": "dpipe.models.krea2.spec:Krea2Spec",
    "ideogram4": "dpipe.models.ideogram4.spec:Ideogram4Spec",
    "ernie_image": "dpipe.models.ernie_image.spec:ErnieImageSpec",
    "omnigen2": "dpipe.models.omnigen2.spec:OmniGen2Spec",
    "minimax_h3": "dpipe.models.minimax_h3.spec:MiniMaxH3Spec",
}


def build_spec(cfg: ModelConfig) -> ModelSpec:
    if cfg.family not in FAMILIES:
        raise ConfigError(
            f"model.family={cfg.family!r} is not known; choose one of: {', '.join(sorted(FAMILIES))}"
        )
    module_name, class_name = FAMILIES[cfg.family].split(":")
    spec_class = getattr(importlib.import_module(module_name), class_name)
    return spec_class(cfg)
