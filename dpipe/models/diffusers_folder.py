"""What every family reads and writes the same way in a diffusers model folder: its configs, whether
it is complete, its frozen encoders (through the family's own diffusers pipeline, so prompts and
images are encoded exactly as at inference), its denoiser (from the folder, or from one single
file with the folder giving the config; each pipeline stage's own weights only:
`dpipe.models.stage_weights`), a trained denoiser written as a folder from per-stage
shards and, for the families with a KL image VAE, latents and the fingerprint of what shaped them.

One way to do each, so every family words a broken folder the same way: the error names the path
and what to change, and a load that fails raises ModelLoadError, never a bare traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from dpipe.errors import ModelLoadError
from dpipe.io import atomic_write_text
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.single_file import export_like_source, load_or_fail, load_transformer_file


def read_json(path: Path) -> dict[str, Any]:
    """A config file of the folder (`vae/config.json`, `model_index.json`, ...)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from None


def check_folder(path: Path, required: tuple[str, ...], what: str, example: str,
                 key: str = "model.path") -> None:
    """Raise ModelLoadError naming what is missing, unless `path` (given as config `key`) is a
    complete diffusers folder of a `what` model, such as a download of `example`."""
    if path.is_file():
        raise ModelLoadError(
            f"{key}={path} is a file: {what} loads from a diffusers folder here (docs/models.md "
            f"lists the families that read single files). Give the folder of a {what} model in "
            f"diffusers format (e.g. a download of {example})")
    if not path.is_dir():
        raise ModelLoadError(
            f"{key}={path} does not exist. Give the folder of a {what} model in diffusers "
            f"format (e.g. a download of {example})")
    missing = [p for p in required if not (path / p).exists()]
    if missing:
        raise ModelLoadError(
            f"{key}={path} is not a complete {what} diffusers folder: missing {', '.join(missing)}")
    for denoiser in DENOISER_FOLDERS:
        config = path / denoiser / "config.json"
        quantization = read_json(config).get("quantization_config") if config.is_file() else None
        if quantization is not None:
            method = quantization.get("quant_method", "quantized")
            raise ModelLoadError(
                f"{config} holds a quantization_config ({method}): dpipe trains from the "
                "weights in bf16 or fp32 (model.base_dtype=fp8 or int8 quantizes the frozen "
                "weights itself); give a folder with the unquantized weights")


# The folders of a diffusers pipeline that hold the denoiser (or its second expert).
DENOISER_FOLDERS = ("transformer", "transformer_2", "unconditional_transformer", "unet")


def load_encoders(pipeline_cls, path: Path, device: torch.device, dtype: torch.dtype,
                  frozen: tuple[str, ...], **components: Any) -> Any:
    """The family's diffusers pipeline without its denoiser, on `device`, its `frozen` parts
    (VAE, text encoders) in eval mode without gradients. `components` replace or leave out more
    of the pipeline's parts (`tokenizer=None`, ...)."""
    pipe = load_or_fail(lambda: pipeline_cls.from_pretrained(
        path, transformer=None, dtype=dtype, **components), path)
    pipe.to(device)
    for name in frozen:
        getattr(pipe, name).requires_grad_(False).eval()
    return pipe


def load_denoiser(model_cls, path: Path, single_file: Path | None, dtype: torch.dtype,
                  convert: Callable | None = None, subfolder: str = "transformer",
                  title: str | None = None,
                  gguf_architectures: tuple[str, ...] = (),
                  keep_stored: bool = False) -> nn.Module:
    """The denoiser from the folder's `subfolder`, or, given `single_file`, from that file with
    the folder's config (`convert(state, model)` maps the file's names where they are not
    diffusers'; a GGUF file's `general.architecture` is one of `gguf_architectures`;
    `keep_stored`: see `load_transformer_file`)."""
    if single_file is not None:
        return load_or_fail(lambda: load_transformer_file(
            model_cls, path / subfolder, single_file, dtype, convert=convert, title=title,
            gguf_architectures=gguf_architectures, keep_stored=keep_stored), single_file)
    return load_or_fail(lambda: model_cls.from_pretrained(
        path, subfolder=subfolder, dtype=dtype), path / subfolder)


def kl_image_fingerprint(family: str, path: Path) -> dict[str, Any]:
    """All that shapes `kl_latents` besides the image: the VAE's weights and its scale and shift."""
    vae = read_json(path / "vae" / "config.json")
    return {"family": family, "vae": folder_fingerprint(path / "vae"),
            "scaling_factor": vae.get("scaling_factor"), "shift_factor": vae.get("shift_factor"),
            "latent": "mode"}


@torch.no_grad()
def kl_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels (B, 3, H, W) in [-1, 1] -> the latents a KL VAE's pipelines train on: the
    distribution's mode, shifted (SDXL's VAE has no shift) and scaled."""
    latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
    shift = vae.config.shift_factor or 0.0
    return (latents - shift) * vae.config.scaling_factor


@torch.no_grad()
def wan_vae_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, F, H, W) in [-1, 1] -> the mean of a Wan-layout video VAE (Wan's, Qwen-Image's;
    Cosmos-Predict2, Anima, Krea 2 use them), normalised as the pipelines do:
    (z - latents_mean) / latents_std (* sigma_data, which is 1)."""
    latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
    std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
    return (latents - mean) / std


def wan_vae_image_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) images through a Wan-layout video VAE as one frame each -> (B, C, h, w)
    (Qwen-Image's and Krea 2's latents)."""
    return wan_vae_latents(vae, pixels[:, :, None])[:, :, 0]


@torch.no_grad()
def wan_vae_decoded(vae, latents: torch.Tensor) -> torch.Tensor:
    """The way back, as the Wan and Qwen-Image pipelines decode: latents (1, C, F, h, w) /
    (1 / latents_std) + latents_mean through the VAE (which clamps to [-1, 1]): (3, F, H, W)."""
    c = vae.config
    x = latents.to(vae.device, vae.dtype)
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(x)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(x)
    return vae.decode(x / inv_std + mean, return_dict=False)[0][0].float()


def write_denoiser_folder(shards: list[Path], out_dir: Path, config_path: Path) -> Path:
    """Per-stage safetensors shards of a denoiser (its diffusers names) -> a diffusers model
    folder that `from_pretrained` reads as is, with the config at `config_path`. The shards are
    moved, not copied."""
    from safetensors.torch import load_file

    out_dir.mkdir(parents=True)
    shutil.copyfile(config_path, out_dir / "config.json")
    if len(shards) == 1:
        shutil.move(shards[0], out_dir / "diffusion_pytorch_model.safetensors")
        return out_dir
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = load_file(shard)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({key: name for key in tensors})
        shutil.move(shard, out_dir / name)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(out_dir / "diffusion_pytorch_model.safetensors.index.json",
                      json.dumps(index, indent=2))
    return out_dir


def write_transformer_folder(shards: list[Path], out_dir: Path, model_path: Path,
                             single_file: Path | None = None, to_original=None) -> Path:
    """A full fine-tune as `out_dir / "transformer"`, a diffusers model folder with the base
    model's config; where the base came as one file, also laid out and named as that file, so the
    tools that loaded it load the fine-tune the same way (`to_original` maps diffusers names to
    the file's). Returns the folder."""
    folder = write_denoiser_folder(shards, out_dir / "transformer",
                                   model_path / "transformer" / "config.json")
    if single_file is not None:
        export_like_source(folder, single_file, to_original, out_dir)
    return folder
