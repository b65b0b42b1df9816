"""Which LTX-2 release a folder or single file holds, so that each dpipe family takes its own.

LTX-2.0 (`model=ltx2`) and LTX-2.3 (`model=ltx23`) run the same diffusers classes
(LTX2VideoTransformer3DModel, LTX2TextConnectors, ...) with different switches. The transformer's
config tells them apart (2.3: `cross_attn_mod`, `gated_attn`, no `caption_projection`), and so
do a single file's top-level transformer names (2.3: `prompt_adaln_single`; 2.0:
`caption_projection`). LTX-2.5 (a video FFN without bias, keyframe embeddings) is neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpipe.errors import ModelLoadError
from dpipe.models.diffusers_folder import read_json

# release -> (dpipe family, what to download)
RELEASES = {"2.0": ("ltx2", "Lightricks/LTX-2"),
            "2.3": ("ltx23", "diffusers/LTX-2.3-Diffusers")}
PIPELINE = "LTX2Pipeline"


def release_of_config(config: dict[str, Any]) -> str:
    """The release a transformer/config.json describes."""
    if config.get("use_keyframes_abs_pos_embedding") or config.get("ff_bias", True) is False:
        return "2.5"
    return "2.3" if config.get("cross_attn_mod") else "2.0"


def release_of_file(file: Path) -> str | None:
    """The release of a single file's transformer from its tensor names (a safetensors header:
    no tensor is read), None when the names are no LTX-2 transformer's (or the file is not
    safetensors): the loader then says which weights are missing."""
    if file.suffix != ".safetensors":
        return None
    from safetensors import safe_open

    try:
        with safe_open(file, "pt") as f:
            keys = list(f.keys())
    except (OSError, ValueError):
        return None  # read_single_file reports an unreadable file
    top = {k.removeprefix("model.").removeprefix("diffusion_model.").split(".", 1)[0]
           for k in keys}
    if "keyframes_abs_pos_embedding" in top:
        return "2.5"
    if top & {"prompt_adaln_single", "prompt_adaln"}:
        return "2.3"
    if "caption_projection" in top:
        return "2.0"
    return None


def _name(release: str) -> str:
    return f"LTX-{release}"


def check_release(folder: Path, single_file: Path | None, want: str) -> None:
    """Raise ModelLoadError naming the file when the folder (its model_index.json and
    transformer/config.json) or the single file holds another model than LTX-`want`."""
    index = folder / "model_index.json"
    pipeline = read_json(index).get("_class_name")
    if pipeline != PIPELINE:
        raise ModelLoadError(
            f"{index} names a {pipeline}, not {PIPELINE}: model.path={folder} is not an "
            f"{_name(want)} folder (model={RELEASES[want][0]} reads a download of "
            f"{RELEASES[want][1]})")
    config = folder / "transformer" / "config.json"
    found = release_of_config(read_json(config))
    if found != want:
        raise ModelLoadError(f"{config} describes an {_name(found)} transformer, not "
                             f"{_name(want)}: {_use(found)}")
    if single_file is not None:
        found = release_of_file(single_file)
        if found is not None and found != want:
            raise ModelLoadError(f"{single_file} holds an {_name(found)} transformer, not "
                                 f"{_name(want)}: {_use(found)}")


def _use(release: str) -> str:
    if release in RELEASES:
        family, example = RELEASES[release]
        return f"use model={family} for it (e.g. {example})"
    return f"dpipe does not train {_name(release)} yet"
