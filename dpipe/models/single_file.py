"""Single-file transformers: loading them, and writing a full fine-tune back in their layout.

Users hold transformers as single files (ComfyUI's model folders, the original releases). A single
file brings only the denoiser: `model.path=<file>` with `model.single_file_config=<the base
model's diffusers folder>` for the VAE, text encoders, tokenizers and configs (`split_path`);
`load_transformer_file` reads the file into the diffusers class, through the family's converter
when the file uses the original names.

Users who trained from a single-file checkpoint load the result where they loaded the file, so the
export writes one more file, named as the source, beside the diffusers folder: every key of the
source in its order, prefix and dtype, each transformer weight replaced by the trained one, and
what the source holds besides the transformer (LTX-Video's VAE, NVIDIA's training buffers) copied
unchanged (`export_like_source`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from dpipe.errors import ModelLoadError

# Prefixes in front of the original names in the files users hold: ComfyUI's saves, NVIDIA's.
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.")

SINGLE_FILE_SUFFIXES = (".safetensors",)


def split_path(cfg, suffixes: tuple[str, ...] = SINGLE_FILE_SUFFIXES) -> tuple[Path, Path | None]:
    """(diffusers folder, single-file transformer or None) from model.path and
    model.single_file_config. A single file (the transformer as ComfyUI and the original
    releases store it) brings only the denoiser; the VAE, text encoder, tokenizer and configs come
    from the base model's diffusers folder named by model.single_file_config. `suffixes`: the
    file types the family's releases use (NVIDIA's Cosmos checkpoints are also .pt)."""
    from dpipe.errors import ConfigError

    path = Path(cfg.path).expanduser()
    config = getattr(cfg, "single_file_config", None)
    if path.suffix not in suffixes:
        if config is not None:
            raise ConfigError("model.single_file_config is only used when model.path is a single-"
                              f"file transformer ({', '.join(suffixes)})")
        return path, None
    if not config:
        raise ConfigError(
            f"model.path={path} is a single-file transformer; the VAE, text encoder and configs "
            "come from the base model's diffusers folder: set model.single_file_config=<folder>")
    return Path(config).expanduser(), path


def check_single_file(single_file: Path | None) -> None:
    if single_file is not None and not single_file.is_file():
        raise ModelLoadError(f"model.path={single_file} does not exist")


def load_transformer_file(model_cls, config_dir: Path, file: Path, dtype: torch.dtype,
                          convert: Callable | None = None) -> torch.nn.Module:
    """A diffusers transformer from one file (read as diffusers' `from_single_file` reads it:
    safetensors, or a torch pickle loaded weights-only): keys stripped of ComfyUI's
    "model.diffusion_model." prefix, mapped by `convert(state, model)` when the file uses other
    names, loaded into weights allocated once (no random init of billions of parameters)."""
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_utils import load_single_file_checkpoint

    state = {k.removeprefix("model.").removeprefix("diffusion_model."): v
             for k, v in load_single_file_checkpoint(str(file)).items()}
    with init_empty_weights():
        model = model_cls.from_config(model_cls.load_config(config_dir))
    if convert is not None:
        try:
            state = convert(state, model)
        except (KeyError, RuntimeError, ValueError) as err:  # names or sizes of another model
            raise ModelLoadError(
                f"{file} is not a {model_cls.__name__} checkpoint in the layout dpipe reads "
                f"(converting its names failed: {err!r})") from None
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"{file} is not a {model_cls.__name__} checkpoint in the layout dpipe reads: "
            f"{len(missing)} weights missing (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:3]})")
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(dtype)


def load_or_fail(fn: Callable[[], Any], what: Path):
    try:
        return fn()
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load {what}: {err}") from None


def write_transformer_file(transformer_dir: Path, file: Path, to_original: Callable,
                           prefix: str = "", dtype: torch.dtype | None = None) -> Path:
    """The diffusers transformer in `transformer_dir` (its safetensors shards) as one file of the
    original layout: names mapped by `to_original`, each key after `prefix` ("model.diffusion_model."
    as ComfyUI saves), in `dtype` (None: as stored). The tiny factories' single files."""
    from safetensors.torch import load_file, save_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(transformer_dir).glob("*.safetensors")):
        weights.update(load_file(shard))
    save_file({prefix + k: (v if dtype is None else v.to(dtype)).contiguous()
               for k, v in to_original(weights).items()},
              file, metadata={"format": "pt"})
    return file


def export_like_source(folder: Path, source: Path, to_original: Callable, out_dir: Path) -> Path:
    """Write the diffusers transformer in `folder` (its safetensors shards) as `out_dir /
    source.name`, laid out as `source`. `to_original` maps diffusers names to the original
    names without prefix. Returns the file written."""
    from diffusers.loaders.single_file_utils import load_single_file_checkpoint
    from safetensors.torch import load_file, save_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(shard))
    trained = to_original(weights)
    out, placed = {}, set()
    for key, value in load_single_file_checkpoint(str(source)).items():
        name = _unprefixed(key)
        if name in trained:
            out[key] = trained[name].to(value.dtype).contiguous()
            placed.add(name)
        else:
            out[key] = value
    left = sorted(set(trained) - placed)
    if left:
        raise ModelLoadError(f"{source} has no place for trained weights {left[:3]} "
                             f"({len(left)} in all): not the layout it was loaded from")
    path = out_dir / source.name
    if source.suffix == ".pt":
        torch.save(out, path)
    else:
        save_file(out, path, metadata={"format": "pt"})
    return path


def _unprefixed(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key
