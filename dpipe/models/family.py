"""The shared family layer: a family whose model is a diffusers folder says what it is, and inherits
how that is found, loaded, fingerprinted, exported and sampled.

A family subclasses `DiffusersFamily` and declares (class attributes, see each below): its title
and a download users know, its diffusers pipeline and denoiser classes, the folder's required
parts and its frozen encoders, how its VAE makes latents and what shapes cached text and
latents, the tiny model's writer, the LoRA targets, the pipeline layers and what counts them, its
loss and its sampler. What it writes itself is what truly differs: how prompts are encoded
(`encode_prompts`, and `encode_images` where images need more than the VAE, as clips' frame
counts checked), the denoiser's inputs (`make_inputs`, `denoiser_forward`), benchmark samples,
and any LoRA format beside diffusers' (`lora_formats`).
Every default is an ordinary method: a family overrides one where it differs, and says why.

Declarations that name code run late ("module:name" strings for the tiny writer and the sampler)
are imported when first used: the launcher imports every spec it checks, and those modules pull
in model code that only workers need (and the sampler imports its family's spec).
"""

from __future__ import annotations

import copy
import importlib
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from dpipe.diffusion.flow_matching import noisy_latents, velocity_target
from dpipe.diffusion.loss import image_loss
from dpipe.errors import ModelLoadError
from dpipe.models import tiny_stamp
from dpipe.models.common.gguf_files import GGUF_SUFFIX, with_plain_linears
from dpipe.models.diffusers_folder import (
    check_folder, kl_latents, load_denoiser, load_encoders, read_json, write_denoiser_folder)
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, LoraFormat, peft_to_diffusers, save_diffusers_lora, write_lora_files)
from dpipe.models.single_file import (
    SINGLE_FILE_SUFFIXES, check_single_file, export_like_source, keeps_stored_base, load_or_fail,
    split_path)
from dpipe.models.spec import (
    EDGE_LAYER_TIME, ModelSpec, PipelineLayer, block_costs, denoiser_config)
from dpipe.models.single_file_weights import file_skeleton, reads_by_tensor
from dpipe.models.stage_weights import folder_skeleton


def imported(target: str) -> Any:
    """The object a "package.module:name" declaration names."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def diffusers_class(name: str) -> Any:
    """diffusers' class `name`, or the class a "module:Class" names (a model dpipe defines in
    diffusers' form, as OmniGen2's transformer)."""
    if ":" in name:
        return imported(name)
    import diffusers

    return getattr(diffusers, name)


class DiffusersFamily(ModelSpec):
    # ---- what the family is -------------------------------------------------------------------
    title: ClassVar[str]  # in messages: "FLUX.1"
    example: ClassVar[str]  # a download users know: "black-forest-labs/FLUX.1-dev"
    pipeline_class: ClassVar[str]  # the diffusers pipeline that loads the folder and samples
    # The model class that is trained: diffusers' name, or "module:Class" for one dpipe defines.
    denoiser_class: ClassVar[str]
    denoiser_folder: ClassVar[str] = "transformer"
    required_parts: ClassVar[tuple[str, ...]]  # what a complete folder holds
    # The folder's pipeline index: model_index.json, or a modular pipeline's own
    # (modular_model_index.json), which must name `pipeline_class`. A modular family refuses a
    # diffusers folder of another model by its class, with advice where one is known (a class
    # name's start -> what to do instead).
    index_file: ClassVar[str] = "model_index.json"
    other_folder_advice: ClassVar[dict[str, str]] = {}
    # The pipeline's parts that encode for the cache (frozen, eval), and parts it can load
    # without that are never used (a prompt enhancer): left out of every load.
    frozen_parts: ClassVar[tuple[str, ...]] = ("vae", "text_encoder")
    unused_parts: ClassVar[tuple[str, ...]] = ()
    # Parts that encode sound (an audio VAE): frozen with model.audio=true, else left out.
    audio_parts: ClassVar[tuple[str, ...]] = ()
    # What shapes cached text: fingerprint key -> the folder (or folders) whose files count, and
    # fixed notes (how the family lays out the encoder's output), with model.max_text_tokens.
    text_fingerprint: ClassVar[dict[str, str | tuple[str, ...]]] = {
        "text_encoder": "text_encoder", "tokenizer": "tokenizer"}
    text_notes: ClassVar[dict[str, Any]] = {}
    # How images become latents, `image_latents(vae, pixels)`, and what shapes cached latents
    # besides the VAE's files: keys of its config, and fixed notes. The default is a KL VAE's:
    # the distribution's mode, shifted and scaled.
    image_latents: ClassVar[Callable[[Any, torch.Tensor], torch.Tensor]] = kl_latents
    vae_config_keys: ClassVar[tuple[str, ...]] = ("scaling_factor", "shift_factor")
    image_notes: ClassVar[dict[str, Any]] = {"latent": "mode"}
    # Families that train on sound: how waveforms become latents, `audio_latents(encoders,
    # waveforms)` (`encode_audio`), and what shapes cached audio latents besides the audio VAE's
    # files: keys of its config, and fixed notes.
    audio_latents: ClassVar[Callable[[Any, torch.Tensor], torch.Tensor] | None] = None
    audio_config_keys: ClassVar[tuple[str, ...]] = ()
    audio_notes: ClassVar[dict[str, Any]] = {}
    # The side of the latent patches the denoiser makes tokens of (2: 2x2), by which a pixel
    # size is a multiple of more than the VAE's downscale; None: the denoiser config's
    # patch_size (2 where it names none, diffusers' default).
    latent_patch: ClassVar[int | None] = 1
    tiny_writer: ClassVar[str]  # "module:function" writing the tiny model folder at a path
    lora_modules: ClassVar[str | tuple[str, ...]]  # peft target_modules (a regex or names)
    # Families that train on sound: the regex alternatives ("|...") added to `lora_modules`
    # with model.audio=true (the audio stream's Linears); None: the same targets either way.
    audio_lora_modules: ClassVar[str | None] = None
    # The pipeline layers: a function of the denoiser; the denoiser config keys that count its
    # blocks, and the layers besides them (embedding, head) in `edge_layers`.
    layers: ClassVar[Callable[[nn.Module], list[PipelineLayer]]]
    block_count_keys: ClassVar[tuple[str, ...]] = ("num_layers",)
    edge_layers: ClassVar[int] = 2
    # Layer classes that cost one block each when stages are balanced (the rest cost
    # `edge_layer_cost`); empty: balance by parameter count.
    block_types: ClassVar[tuple[type, ...]] = ()
    edge_layer_cost: ClassVar[float] = EDGE_LAYER_TIME
    # The loss of the per-element error given the labels, (target,) or (target, weight, ...):
    # `image_loss`, or the latents' own (`video_loss`: mask weights broadcast over frames too).
    error_loss: ClassVar[Callable[[torch.Tensor, tuple], torch.Tensor]] = image_loss
    # What a flow-matching denoiser predicts of (x0, noise): the velocity noise - x0 by default.
    flow_target: ClassVar[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = velocity_target
    sampler: ClassVar[str | None] = None  # "module:Class", a dpipe.models.sampling.FamilySampling
    # The diffusers class whose `save_lora_weights` writes the LoRA file (the pipeline where it
    # has a LoRA loader; else a mixin that writes the same layout), and the pipeline's component.
    lora_writer: ClassVar[str | None] = None
    lora_component: ClassVar[str] = "transformer"
    # Single-file transformers (the original and ComfyUI layout) the family reads: their
    # suffixes, or None where it reads only folders.
    single_file_suffixes: ClassVar[tuple[str, ...] | None] = None
    # The `general.architecture` names of the family's GGUF transformers (city96's tools write
    # the original names, as its single files hold): a family that names them reads .gguf files
    # too, kept quantized (dpipe.models.common.gguf_files).
    gguf_architectures: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg):
        super().__init__(cfg)
        self.single_file: Path | None = None
        if self.single_file_suffixes is not None:
            # model.path: the diffusers folder, or a single file with model.single_file_config
            # naming the diffusers folder for the rest.
            gguf = (GGUF_SUFFIX,) if self.gguf_architectures else ()
            self.path, self.single_file = split_path(cfg, self.single_file_suffixes + gguf)

    # ---- the folder ---------------------------------------------------------------------------
    def ensure_available(self) -> None:
        if self.modular:
            self.refuse_other_pipeline()  # named before it is found incomplete
        if self.cfg.tiny and tiny_stamp.needs_writing(self.path):
            imported(self.tiny_writer)(self.path)
        check_folder(self.path, self.required_parts, self.title, self.example)
        check_single_file(self.single_file)
        self.read_configs()

    @property
    def modular(self) -> bool:
        """Whether the folder is a modular pipeline's (`index_file`)."""
        return self.index_file != "model_index.json"

    def refuse_other_pipeline(self) -> None:
        """A modular family's model.path that is a (non-modular) diffusers folder of another
        model: refused naming its pipeline."""
        other = self.path / "model_index.json"
        if self.path.is_dir() and not (self.path / self.index_file).is_file() and other.is_file():
            name = str(read_json(other).get("_class_name"))
            advice = [tip for start, tip in self.other_folder_advice.items()
                      if name.startswith(start)]
            raise ModelLoadError(
                f"model.path={self.path} is a {name} folder, not {self.title} ({other}): a "
                f"{self.title} folder is a modular pipeline with {self.index_file} "
                f"({self.pipeline_class}), as {self.example}" + "".join(f"; {a}" for a in advice))

    def read_configs(self) -> None:
        """Reads the configs training needs, so that a broken folder fails before any worker
        starts. Default: a modular pipeline's index (naming `pipeline_class`), the VAE's where
        the folder has one, and the denoiser's where `pixel_multiple` reads its patch size."""
        if self.modular:
            name = read_json(self.path / self.index_file).get("_class_name")
            if name != self.pipeline_class:
                raise ModelLoadError(f"{self.path / self.index_file} names {name}, not "
                                     f"{self.pipeline_class}: not a folder of {self.title}")
        if "vae" in self.required_parts:
            self.part_config("vae")
        if self.latent_patch is None:
            self.part_config(self.denoiser_folder)

    def folder_config(self, relative: str) -> dict[str, Any]:
        """A JSON file of the model folder (`relative` to it); in `for_benchmark`'s copy, the
        size's (`bench_folder`)."""
        if self.bench_size is not None:
            return self.bench_folder(self.bench_size)[relative]
        return read_json(self.path / relative)

    def part_config(self, part: str) -> dict[str, Any]:
        """`part`/config.json of the model folder."""
        return self.folder_config(f"{part}/config.json")

    @property
    def pixel_multiple(self) -> int:
        """The VAE's downscale (a KL VAE's 2 per level after the first; a video VAE's, as Wan's
        and Qwen-Image's, 2 per temporal-downsample entry) times the latent patch."""
        vae = self.part_config("vae")
        levels = len(vae["temperal_downsample"]) if "temperal_downsample" in vae \
            else len(vae["block_out_channels"]) - 1
        patch = self.latent_patch or int(
            self.part_config(self.denoiser_folder).get("patch_size", 2))
        return 2 ** levels * patch

    # ---- components ---------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        sound = self.cfg.audio if self.audio_parts else False
        frozen = self.frozen_parts + (self.audio_parts if sound else ())
        unused = self.unused_parts + (() if sound else self.audio_parts)
        return load_encoders(diffusers_class(self.pipeline_class), self.path, device, dtype,
                             frozen=frozen, **dict.fromkeys(unused))

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        return load_denoiser(diffusers_class(self.denoiser_class), self.path, self.single_file,
                             dtype, convert=type(self).from_single_file,
                             subfolder=self.denoiser_folder, title=self.title,
                             gguf_architectures=self.gguf_architectures,
                             keep_stored=keeps_stored_base(self.cfg))

    @property
    def loads_stage_weights(self) -> bool:
        """From a diffusers folder, or a safetensors single file (plain or quantized) or a GGUF
        file, where the family's skeleton matches its `load_denoiser`: the default pair, or a
        family's own pair (Anima's two models). A family with its own `load_denoiser` but the
        default skeleton loads whole, unless it says otherwise (SDXL, whose own is for single
        files only)."""
        own_load = type(self).load_denoiser is not DiffusersFamily.load_denoiser
        own_skeleton = type(self).denoiser_skeleton is not DiffusersFamily.denoiser_skeleton
        if own_load and not own_skeleton:
            return False
        return self.single_file is None or reads_by_tensor(self.single_file)

    def denoiser_skeleton(self):
        """From the folder's safetensors files (None where it holds none), or from the single
        file through the family's converter (`from_single_file`)."""
        if not self.loads_stage_weights:
            return None
        model_cls = diffusers_class(self.denoiser_class)
        if self.single_file is not None:
            return file_skeleton(model_cls, self.path / self.denoiser_folder, self.single_file,
                                 type(self).from_single_file, model_cls.__name__,
                                 keeps_stored_base(self.cfg), self.gguf_architectures,
                                 self.title)
        return folder_skeleton(model_cls, self.path / self.denoiser_folder)

    # A single file's names -> diffusers' (`convert(state, model)`), where they differ; and the
    # way back, for the export in the file's layout (`to_original(diffusers_names_state)`).
    from_single_file: ClassVar[Callable | None] = None
    to_original: ClassVar[Callable | None] = None

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "audio":
            vae = self.part_config("audio_vae") if self.audio_config_keys else {}
            return {"family": self.family, "audio_vae": folder_fingerprint(self.path / "audio_vae"),
                    **{key: vae.get(key) for key in self.audio_config_keys}, **self.audio_notes}
        if kind == "image":
            vae = self.part_config("vae")
            return {"family": self.family, "vae": folder_fingerprint(self.path / "vae"),
                    **{key: vae.get(key) for key in self.vae_config_keys}, **self.image_notes}
        parts = {key: ([folder_fingerprint(self.path / f) for f in folder]
                       if isinstance(folder, tuple) else folder_fingerprint(self.path / folder))
                 for key, folder in self.text_fingerprint.items()}
        return {"family": self.family, **parts, "max_text_tokens": self.cfg.max_text_tokens,
                **self.text_notes}

    # ---- caching ------------------------------------------------------------------------------
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        """The declared `image_latents` of the VAE (the function itself, not bound to self)."""
        return type(self).image_latents(encoders.vae, pixels)

    def encode_audio(self, encoders: Any, waveforms: torch.Tensor) -> torch.Tensor:
        """The declared `audio_latents` (the function itself, not bound to self)."""
        if self.audio_latents is None:
            return super().encode_audio(encoders, waveforms)
        return type(self).audio_latents(encoders, waveforms)

    # ---- training -----------------------------------------------------------------------------
    def lora_targets(self) -> str | list[str]:
        modules = self.lora_modules
        if self.audio_lora_modules is not None and self.cfg.audio:
            return modules + self.audio_lora_modules
        return list(modules) if isinstance(modules, tuple) else modules

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return type(self).layers(denoiser)  # the function itself, not bound to self

    def pipeline_layer_count(self) -> int | None:
        if self.bench_size is not None:  # the size's config, whole
            config = self.part_config(self.denoiser_folder)
            return self.edge_layers + sum(config[key] for key in self.block_count_keys)
        blocks = denoiser_config(self.path / self.denoiser_folder, self.denoiser_class,
                                 *self.block_count_keys)
        return self.edge_layers + sum(blocks)

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        if self.block_types:
            return block_costs(layers, self.block_types, self.edge_layer_cost)
        return super().layer_costs(layers)

    def noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
        return noisy_latents(x0, noise, t), type(self).flow_target(x0, noise)

    def loss(self, outputs, labels) -> torch.Tensor:
        # the function itself, not bound to self
        return type(self).error_loss(self.element_error(outputs, labels[0]), labels)

    # ---- sampling -----------------------------------------------------------------------------
    def sampling(self):
        if self.sampler is None:
            return super().sampling()
        return imported(self.sampler)(self)

    # ---- export -------------------------------------------------------------------------------
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        weights = peft_to_diffusers(state_dict)
        loader = diffusers_class(self.lora_writer or self.pipeline_class)
        return write_lora_files(
            out_dir, lambda: save_diffusers_lora(loader, weights, metadata, out_dir,
                                                 component=self.lora_component),
            weights, metadata, self.lora_formats)

    def lora_formats(self, weights: dict[str, torch.Tensor],
                     metadata: dict[str, Any]) -> list[LoraFormat]:
        """The LoRA files besides diffusers' (ComfyUI's, kohya's), from diffusers-named
        `weights`. Default: none."""
        return []

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        folder = write_denoiser_folder(shards, out_dir / self.denoiser_folder,
                                       self.path / self.denoiser_folder / "config.json")
        if self.single_file is not None:
            self.export_single_file(folder, out_dir)
        return folder

    def export_single_file(self, folder: Path, out_dir: Path) -> Path | None:
        """The fine-tune also laid out, named and typed as the single file it came from, so the
        tools that loaded that file load it the same way; none where the family has no way back
        to the file's names (`to_original` None: diffusers converts those files on loading)."""
        if type(self).to_original is None:
            return None
        return export_like_source(folder, self.single_file, type(self).to_original, out_dir)

    # ---- using exported weights ---------------------------------------------------------------
    def load_denoiser_with_lora(self, lora_dir: Path,
                                weight_name: str = DIFFUSERS_LORA) -> nn.Module:
        # A GGUF base's Linears as the fp32 values they hold: diffusers' LoRA loaders read the
        # Linears' weights.
        denoiser = with_plain_linears(self.load_denoiser(torch.float32))
        pipe = load_or_fail(lambda: self._pipeline_with(denoiser), self.path)
        pipe.load_lora_weights(str(lora_dir), weight_name=weight_name)
        return getattr(pipe, self.denoiser_folder)

    def _pipeline_with(self, denoiser: nn.Module) -> Any:
        """The folder's pipeline holding `denoiser` and none of the other models: only the
        denoiser carries the LoRA."""
        cls = diffusers_class(self.pipeline_class)
        if self.modular:  # its components load when asked, and none is
            pipe = cls.from_pretrained(str(self.path))
            pipe.update_components(**{self.denoiser_folder: denoiser})
            return pipe
        # Every component (a [library, class] entry of model_index.json; the others are config
        # values) but the denoiser and the scheduler is left out.
        parts = [name for name, value in read_json(self.path / "model_index.json").items()
                 if isinstance(value, list) and name not in ("scheduler", self.denoiser_folder)]
        return cls.from_pretrained(self.path, **dict.fromkeys(parts),
                                   **{self.denoiser_folder: denoiser})

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        return diffusers_class(self.denoiser_class).from_pretrained(
            export_dir / self.denoiser_folder)

    # ---- benchmarks (dpipe-bench: no folder) --------------------------------------------------
    bench_size: str | None = None  # set in `for_benchmark`'s copy

    def bench_folder(self, size: str) -> dict[str, dict[str, Any]]:
        """The folder's JSON files (relative path -> content) that benchmark size `size` stands
        for, where the family reads what its model is from them. Default: none."""
        return {}

    def for_benchmark(self, size: str) -> "DiffusersFamily":
        """A copy that reads the size's `bench_folder` for the folder's files, with every
        cached property dropped (made again from those); this one where there is none."""
        if not self.bench_folder(size):
            return self
        spec = copy.copy(self)
        cached = {name for klass in type(self).__mro__ for name, value in vars(klass).items()
                  if isinstance(value, cached_property)}
        spec.__dict__ = {k: v for k, v in self.__dict__.items() if k not in cached}
        spec.bench_size = size
        return spec


__all__ = ["DiffusersFamily", "SINGLE_FILE_SUFFIXES", "diffusers_class", "imported"]
