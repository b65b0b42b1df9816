"""The model interface: everything family-specific, and the only thing the trainer knows of a model.

A family (Flux, Wan, SDXL, ...) subclasses `ModelSpec` and registers it in `registry.py`. The
trainer then:

1. caches: `load_encoders` once, `encode_images` / `encode_prompts` per item (stored by the cache);
2. trains: `load_denoiser`, `lora_targets`, `pipeline_layers` (an ordered list of modules that pass
   a tuple of tensors from one to the next, split across pipeline stages), `make_inputs` (the first
   layer's input tuple and the loss's label tuple for one micro-batch), `loss`;
3. exports: `export_lora` / `export_full` in the family's public formats;
4. samples: `sampling` (its diffusers pipeline's denoising loop, `dpipe.models.sampling`).

Tensor conventions: images are float tensors in [-1, 1], shape (B, 3, H, W). Cached entries are
dicts of tensors without the batch dimension; the loader stacks them.
"""

from __future__ import annotations

import abc
import contextlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dpipe.config.schema import ModelConfig, TrainConfig
from dpipe.diffusion.flow_matching import noisy_latents, velocity_target
from dpipe.diffusion.loss import ElementError
from dpipe.errors import ConfigError, ModelLoadError
from dpipe.models.adapters import is_adapter_param
from dpipe.models.lora_files import DIFFUSERS_LORA


@dataclass(frozen=True)
class AudioFormat:
    """The sound an audio-video family's audio encoder takes."""

    sample_rate: int  # samples per second per channel
    channels: int  # 1: mono, 2: stereo


def reference_latents(control: torch.Tensor) -> list[torch.Tensor]:
    """A batch's control latents as one (B, C, h, w) tensor per reference, in their order:
    `NoisedBatch.control` is (B, C, h, w) for one reference, (B, R, C, h, w) for several."""
    return [control] if control.dim() == 4 else list(control.unbind(1))


@dataclass(frozen=True)
class NoisedBatch:
    """One micro-batch after noising: what the denoiser sees and what it must predict. The
    training loader makes them from the cache, the samplers one per denoising step; the fields
    after `text` are None where the dataset (or the sample request) has none."""

    latents: torch.Tensor  # clean latents x0
    noise: torch.Tensor
    timesteps: torch.Tensor  # t in [0, 1], shape (B,)
    noisy: torch.Tensor  # x_t
    target: torch.Tensor  # what the model predicts (e.g. noise - x0 for flow matching)
    text: dict[str, torch.Tensor]  # cached text embeddings, batched

    # Per-pixel loss weights at latent resolution, (B, 1, h, w) ((B, 1, 1, h, w) for video),
    # 1 where a sample has no mask. Models multiply their per-element loss by it.
    loss_weight: torch.Tensor | None = None
    # Latents of the control/reference images of edit models, shaped as `latents`; where a
    # sample has several references (families whose `references` > 1), (B, R, C, h, w) in their
    # order: `reference_latents` gives them one by one.
    control: torch.Tensor | None = None
    # How each file was fitted to its bucket (int64, (B, 2)): the source's (height, width) and
    # the (top, left) of the centre crop, in pixels of the source scaled to cover the bucket.
    original_size: torch.Tensor | None = None
    crop_top_left: torch.Tensor | None = None
    # Each clip's frame rate as trained (float32, (B,)); NaN for images (the model's default).
    fps: torch.Tensor | None = None
    # Sampling guidance-distilled models (float32, (B,)): the scale their guidance embedding
    # takes; None in training, where `model.guidance` applies.
    guidance: torch.Tensor | None = None
    # Audio-video families with model.audio=true: each clip's clean audio latents (as
    # `spec.encode_audio` gives them), their noise (its own stream, the sample's t), the noised
    # latents and the target; None otherwise.
    audio: torch.Tensor | None = None
    audio_noise: torch.Tensor | None = None
    audio_noisy: torch.Tensor | None = None
    audio_target: torch.Tensor | None = None
    # Video families taking given frames (`ModelSpec.frame_modes`): each sample's mode, an index
    # into `dpipe.models.frame_modes.FRAME_MODES` (int64, (B,)); None: the checkpoint's own task.
    frame_mode: torch.Tensor | None = None


class PipelineLayer(nn.Module):
    """One pipeline layer, built from submodules of the denoiser.

    Submodules are attached with `adopt(attr, module, source_name)`, which records where they live
    in the denoiser, so weights gathered from every stage can be exported under their public names.
    `PipelineLayer(transformer)` adopts the transformer's top-level modules named in `parts`, each
    under its own name; a block layer, `PipelineLayer(transformer, block, source_name)`
    (`block_layers` makes one per block), adopts its block first, as `block`, then the `parts`
    (where it has some: the rotary module every block shares, parameter-free).
    """

    parts: ClassVar[tuple[str, ...]] = ()

    def __init__(self, transformer: nn.Module | None = None, block: nn.Module | None = None,
                 source_name: str = ""):
        super().__init__()
        self.source_names: dict[str, str] = {}
        if block is not None:
            self.adopt("block", block, source_name)
        for name in self.parts:
            self.adopt(name, getattr(transformer, name), name)

    def adopt(self, attr: str, module: nn.Module | nn.Parameter | None, source_name: str) -> None:
        """Attaches a submodule, or a parameter that the denoiser holds directly (a pad or
        register token, a modulation table), under `attr`; `source_name` is its name there.
        None (a module the model's config leaves out) is set as None, nothing adopted."""
        setattr(self, attr, module)
        if module is not None:
            self.source_names[attr] = source_name

    def source_named_parameters(self):
        """(name in the diffusers model, parameter) of each of the layer's parameters."""
        for name, param in self.named_parameters():
            attr, dot, rest = name.partition(".")
            source = self.source_names[attr]
            yield (f"{source}.{rest}" if source else rest) if dot else source, param

    def denoiser_state_dict(self, trainable_only: bool) -> dict[str, torch.Tensor]:
        return {name: param.detach() for name, param in self.source_named_parameters()
                if param.requires_grad or not trainable_only}


def block_layers(layer: Callable[..., PipelineLayer], transformer: nn.Module, *lists: str,
                 **extra: Any) -> list[PipelineLayer]:
    """`layer(transformer, block, "<list>.<i>", **extra)` for each block of the transformer's
    block lists named in `lists`, in their order."""
    return [layer(transformer, block, f"{name}.{i}", **extra)
            for name in lists for i, block in enumerate(getattr(transformer, name))]


class ModelSpec(abc.ABC):
    family: ClassVar[str]
    # Whether the family trains on `model.min_t`/`max_t` (it maps t with `train_timesteps` where
    # it noises and where it builds the denoiser's inputs); others refuse a range.
    supports_timestep_range: ClassVar[bool] = False
    # The error per element that `loss` averages: MSE unless the trainer sets train.loss.
    element_error: ElementError = ElementError()
    # Whether the family trains on sound with `model.audio=true` (`audio_format`, `encode_audio`,
    # and its layers take the NoisedBatch audio fields); others refuse model.audio=true.
    trains_audio: ClassVar[bool] = False

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.path = Path(cfg.path).expanduser()
        lo, hi = getattr(cfg, "min_t", 0.0), getattr(cfg, "max_t", 1.0)
        if not 0.0 <= lo < hi <= 1.0:
            raise ConfigError(f"model.min_t={lo}, model.max_t={hi}: need 0 <= min_t < max_t <= 1")
        if (lo, hi) != (0.0, 1.0) and not self.supports_timestep_range:
            raise ConfigError(f"model.family={self.family} trains on every t: leave model.min_t=0 "
                              "and model.max_t=1")
        if getattr(cfg, "audio", False) and not self.trains_audio:
            raise ConfigError(f"model.audio=true: model.family={self.family} has no audio to "
                              "train; leave model.audio=false")
        if getattr(cfg, "audio_loss_weight", 1.0) < 0:
            raise ConfigError(f"model.audio_loss_weight={cfg.audio_loss_weight}: give a weight "
                              ">= 0")

    def use_loss(self, train: TrainConfig) -> None:
        """Makes `loss` average the error of `train.loss` (dpipe.diffusion.loss)."""
        self.element_error = ElementError.of(train)

    def train_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """Sampled t in [0, 1] -> the t this model trains on, linearly in [min_t, max_t]."""
        lo, hi = getattr(self.cfg, "min_t", 0.0), getattr(self.cfg, "max_t", 1.0)
        return t if (lo, hi) == (0.0, 1.0) else lo + (hi - lo) * t

    def cached_latent_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a sample of `latent_shape` (its latents as the sampler makes them, no batch
        dimension) takes in the cache: the same, but where a family caches more with a clip
        (LTX-2: its last frame's own latent)."""
        return tuple(latent_shape)

    def training_shift(self, latent_shape: tuple[int, ...]) -> float:
        """`train.timesteps.shift=auto`: the shift of t that the family's sampler applies to
        latents of one sample's `latent_shape` (as cached, no batch dimension); computed once
        per shape from the scheduler config (`FamilySampling.training_shift`)."""
        shape = tuple(int(n) for n in latent_shape)
        shifts = self.__dict__.setdefault("_training_shifts", {})
        if shape not in shifts:
            try:
                sampling = self.sampling()
            except ConfigError:
                raise ConfigError(f"model.family={self.family} has no sampler to take "
                                  "train.timesteps.shift=auto from: give the shift as a "
                                  "number") from None
            # A meta tensor: the shift depends on the shape alone.
            shifts[shape] = sampling.training_shift(torch.empty((1, *shape), device="meta"))
        return shifts[shape]

    # ---- components -------------------------------------------------------------------------
    @abc.abstractmethod
    def ensure_available(self) -> None:
        """Check the model folder is complete (or create the tiny model); raise ModelLoadError."""

    @abc.abstractmethod
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        """VAE and text encoders, frozen, for caching."""

    @abc.abstractmethod
    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        """The diffusion transformer/UNet that is trained, on CPU."""

    @property
    def loads_stage_weights(self) -> bool:
        """Whether each pipeline stage can read only its own weights (`denoiser_skeleton`), or
        every rank loads the whole denoiser (`load_denoiser`). Default: the whole."""
        return False

    def denoiser_skeleton(self):
        """The denoiser with no weights read (`dpipe.models.diffusers_folder.DenoiserSkeleton`),
        so that each pipeline stage reads only its own weights; None where the family loads the
        whole denoiser (`load_denoiser`). Default: None."""
        return None

    @property
    @abc.abstractmethod
    def pixel_multiple(self) -> int:
        """Image sides must be multiples of this (VAE downscale x patch size)."""

    @abc.abstractmethod
    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        """All that shapes cached `kind` ("image" or "text") tensors besides the input itself:
        the encoder weights' identity, latent scaling/shift, sequence length, ..."""

    # ---- caching -----------------------------------------------------------------------------
    @abc.abstractmethod
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) in [-1, 1] -> normalised latents (B, C, h, w)."""

    @abc.abstractmethod
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Prompts -> named embedding tensors with a leading batch dimension."""

    # Families whose pipeline encodes a negative prompt otherwise than a prompt (Lumina 2 puts
    # its system prompt before prompts only): their sample requests' negative prompts are made
    # by `encode_negative_prompts` and cached apart from the captions.
    negative_prompts_differ: ClassVar[bool] = False

    def encode_negative_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Negative prompts -> as `encode_prompts`, encoded as the family's pipeline encodes them."""
        return self.encode_prompts(encoders, prompts)

    # Edit models whose text encoder reads the control image with the prompt (Qwen-Image-Edit):
    # their text entries depend on (caption, control image) and are made by
    # `encode_prompts_with_controls`, not `encode_prompts`.
    text_sees_control: ClassVar[bool] = False
    # How many control (reference) images a sample may have: a dataset item or sample request
    # with more is refused before training. Families taking several use as many as a sample
    # gives (at least one); their `make_inputs` reads them with `reference_latents`.
    references: ClassVar[int] = 1

    def encode_prompts_with_controls(self, encoders: Any, prompts: list[str],
                                     controls: torch.Tensor) -> dict[str, torch.Tensor]:
        """Prompts, each with its control image (B, 3, H, W) in [-1, 1] (several references:
        (B, R, 3, H, W), in their order) -> as `encode_prompts`."""
        raise NotImplementedError(f"model.family={self.family} encodes prompts without images")

    # ---- audio (audio-video families with model.audio=true) -------------------------------------
    def audio_format(self) -> AudioFormat | None:
        """What the family's audio encoder takes when it trains on sound: None (the default)
        where the family has no audio or model.audio is false; the dataset then reads no audio."""
        return None

    def encode_audio(self, encoders: Any, waveforms: torch.Tensor) -> torch.Tensor:
        """Waveforms (B, channels, samples), float in [-1, 1] at `audio_format().sample_rate`
        -> normalised audio latents (B, ...), as the family's pipeline decodes them."""
        raise NotImplementedError(f"model.family={self.family} has no audio encoder")

    # ---- frame conditioning (video families) -----------------------------------------------------
    def frame_modes(self) -> dict[str, float]:
        """The frame modes (`dpipe.models.frame_modes.FRAME_MODES`) this checkpoint takes, each
        with its probability in the checkpoint's own task (the `dataset.conditioning` default):
        text-to-video takes none, image-to-video the first frame, first-last-frame both."""
        return {"none": 1.0}

    # Frame modes whose samples give a clip's tokens one layout: a micro-batch of clips mixes
    # samples of one group only (LTX-2 appends a given last frame's tokens). Empty: any.
    frame_mode_groups: ClassVar[tuple[tuple[str, ...], ...]] = ()

    # ---- training ----------------------------------------------------------------------------
    @abc.abstractmethod
    def lora_targets(self) -> list[str] | str:
        """Default peft `target_modules` for LoRA (a list of names or a full-match regex)."""

    def noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
        """(noisy input, prediction target). Default: flow matching; epsilon models override."""
        return noisy_latents(x0, noise, t), velocity_target(x0, noise)

    @abc.abstractmethod
    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        """The denoiser as an ordered list of layers exchanging tuples of tensors."""

    @abc.abstractmethod
    def pipeline_layer_count(self) -> int | None:
        """len(pipeline_layers(...)) for the denoiser the workers will load, read from its config
        file (`denoiser_config`) without building it, so that `pipeline.stages` or
        `pipeline.split` beyond the model's layers fail before any worker starts. None only
        where no config file is on disk (an SDXL single file whose header does not tell);
        the workers check the count once the denoiser is built."""

    @abc.abstractmethod
    def make_inputs(self, batch: NoisedBatch) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(first layer's input tuple, labels tuple given to `loss`) for one micro-batch."""

    @abc.abstractmethod
    def loss(self, outputs: Any, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Scalar loss from the last layer's outputs and the labels of `make_inputs`: the mean
        of `self.element_error` between prediction and target, with the family's weights."""

    def prior_labels(self, outputs: Any, labels: tuple, rows: list[int]) -> tuple:
        """`labels` with the base model's prediction (`outputs`: the last layer's whole output)
        as the target of the micro-batch's `rows`, so that `loss` on those rows is 0: prior
        preservation (dpipe.train.prior). Default: the first output is laid out as the first
        label; families whose outputs carry more (reference tokens, a second stream) say how."""
        output = outputs if isinstance(outputs, torch.Tensor) else outputs[0]
        target = labels[0]
        if output.shape != target.shape:
            raise ConfigError(f"model.family={self.family} does not support prior_preservation "
                              f"yet (its prediction {tuple(output.shape)} and target "
                              f"{tuple(target.shape)} differ in layout): remove "
                              "prior_preservation from the dataset config")
        return (replace_rows(target, output, rows), *labels[1:])

    # ---- sampling ----------------------------------------------------------------------------
    def sampling(self):
        """The family's `dpipe.models.sampling.FamilySampling`: how its diffusers pipeline
        samples, step by step, through the pipeline layers."""
        raise ConfigError(f"model.family={self.family} cannot sample yet: leave sample.prompts "
                          "empty")

    # ---- benchmarks (dpipe-bench, dpipe.bench.layers: random weights, no download) ------------
    # The denoiser's diffusers configs by size name: published ones, and "tiny" (the test
    # model's, for CPU smoke tests); each names its class in "_class_name". None by default.
    bench_configs: ClassVar[dict[str, dict[str, Any]]] = {}
    # One sample's shapes at each benchmark size, by name ("latents", "audio", the text
    # entries'): what `random_sample` and `random_audio` draw. Empty by default. The text
    # entries `random_sample` draws by default, after the latents, in this order.
    sample_shapes: ClassVar[dict[str, dict[str, Any]]] = {}
    random_text: ClassVar[tuple[str, ...]] = ()
    # The VAE's (spatial, temporal) downscale at the benchmark sizes: a sample's latent shape at
    # another resolution and frame count (dpipe.plan sizes activations with it).
    latent_scale: ClassVar[tuple[int, int]] = (8, 4)
    # Why `denoiser_forward` cannot stand in for training in dpipe-bench's plain reference loop
    # (`--plain`), for a family where it cannot; None where it can.
    plain_loop_unfit: ClassVar[str | None] = None

    def bench_sizes(self) -> tuple[str, ...]:
        """The sizes `random_denoiser` and `random_sample` know."""
        return tuple(self.bench_configs)

    def for_benchmark(self, size: str) -> "ModelSpec":
        """The spec as it stands for a benchmark size, without the model's folder. Default: this
        one; a family that reads what its model is from the folder (Wan) returns a copy that
        knows it from the size."""
        return self

    def random_denoiser(self, size: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The denoiser at a benchmark size with random weights."""
        import diffusers

        config = self.bench_configs[size]
        with torch.device(device):
            model = getattr(diffusers, config["_class_name"]).from_config(config)
        return model.to(dtype)

    def random_sample(self, size: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One sample's (latents, text embeddings) at the size's training resolution, random:
        of the `sample_shapes` of "latents" and of each of `random_text`."""
        if not self.random_text:
            raise NotImplementedError(f"{self.family}: no real-size configs for benchmarks")
        shapes = self.sample_shapes[size]
        latents = torch.randn(shapes["latents"])
        return latents, {key: torch.randn(shapes[key]) for key in self.random_text}

    def random_audio(self, size: str) -> torch.Tensor:
        """One sample's audio latents at the size's clip, random (dpipe-bench with
        model.audio=true): of the shape `sample_shapes` gives as "audio"."""
        shape = self.sample_shapes.get(size, {}).get("audio")
        if shape is None:
            raise NotImplementedError(f"{self.family}: no audio at its benchmark sizes")
        return torch.randn(shape)

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        """Model FLOPs of one training step on `inputs` (a micro-batch): 6 x params x tokens for
        a full fine-tune, 4 x for LoRA (no weight gradients), plus attention; no recompute."""
        raise NotImplementedError(f"{self.family}: no FLOP count")

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """Relative time per layer, for balancing stages (`pipeline.partition=balanced`).
        Default: the parameter count; families override it with measured or modelled times."""
        return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]

    # ---- export ------------------------------------------------------------------------------
    @abc.abstractmethod
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        """Write LoRA weights (peft names relative to the denoiser) in the public formats, with
        the adapter's `metadata` (`dpipe.models.adapters.adapter_metadata`: rank, alpha,
        targets), which the trainer computes."""

    @abc.abstractmethod
    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        """Turn per-stage safetensors shards of the denoiser into the family's model folder."""

    # ---- using exported weights (sampling, checks) -------------------------------------------
    @abc.abstractmethod
    def denoiser_forward(self, denoiser: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The denoiser's own (diffusers) forward on `make_inputs`' input tuple: what the
        pipeline layers must reproduce."""

    @abc.abstractmethod
    def load_denoiser_with_lora(self, lora_dir: Path,
                                weight_name: str = DIFFUSERS_LORA) -> nn.Module:
        """The base denoiser with an exported LoRA (its file `weight_name` in `lora_dir`: the
        diffusers one, or another format diffusers reads) loaded the way users load it
        (diffusers' pipeline `load_lora_weights`)."""

    @abc.abstractmethod
    def load_exported_full(self, export_dir: Path) -> nn.Module:
        """The denoiser from a full fine-tune's export folder, via `from_pretrained`."""


def denoiser_config(folder: Path, class_name: str, *keys: str) -> list[Any]:
    """The values of `keys` in the denoiser config `folder`/config.json, as diffusers'
    `class_name` (or the class a "module:Class" names) reads them: a key the file leaves out
    takes the class's default (the class is imported only then: this runs in the launcher,
    before any worker)."""
    import json

    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from None
    missing = [key for key in keys if key not in config]
    if missing:
        import importlib
        import inspect

        module, _, name = class_name.rpartition(":")
        model_cls = getattr(importlib.import_module(module or "diffusers"), name)
        params = inspect.signature(model_cls.__init__).parameters
        config = {**{k: params[k].default for k in missing}, **config}
    return [config[key] for key in keys]


# The embedder's and the head's time relative to a transformer block, measured on FLUX.1-dev
# (docs/bench-results/h200-1gpu-stage): a few Linears, but memory-bound ones.
EDGE_LAYER_TIME = 0.18


def block_costs(layers: list[PipelineLayer], block_types,
                edge: float = EDGE_LAYER_TIME) -> list[float]:
    """Equal costs for every transformer block, `edge` for the other layers: for families whose
    blocks are alike in work (double-stream blocks, with separate weights per stream, do the
    FLOPs per token of single-stream ones, though they hold ~2.4x the parameters; measured on
    FLUX.1-dev, a double block takes 1.07x a single one (full fine-tune), 1.21x with LoRA) and
    whose other layers are a few Linears over the tokens."""
    return [1.0 if isinstance(layer, block_types) else edge for layer in layers]


def counted_layer_flops(layers: list[PipelineLayer], inputs: tuple[torch.Tensor, ...],
                        fake: bool = True) -> list[float]:
    """Forward FLOPs of each layer on `inputs`, passed from layer to layer, as torch's
    FlopCounterMode counts them: a family's `layer_costs` where its layers differ in kind.
    `fake`: on fake copies of the inputs, which carry shapes but no memory and run no kernels
    (seconds at real size on the CPU); otherwise on the tensors themselves. Attention goes
    through SDPA's math path, whose matmuls the counter counts (it has no formula for the fused
    CPU kernel)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # A rank counts the same layers twice (the stage it reads, then the engine's split): the
    # count is a function of the layers' kinds and parameter shapes (not their dtypes: the first
    # count sees a stage's weights before they are cast) and of the inputs' shapes.
    key = (fake, tuple((type(layer).__qualname__, tuple(
               (name, tuple(p.shape)) for name, p in layer.named_parameters()))
               for layer in layers),
           tuple((tuple(t.shape), t.dtype) for t in inputs))
    if key in _COUNTED:
        return list(_COUNTED[key])
    flops = []
    # In the layers' own float dtype: a bf16 run's frozen weights are bf16, and a conv refuses
    # fp32 inputs with them outside autocast (SDXL's bf16 LoRA failed so before its first step).
    dtypes: Counter = Counter()
    for layer in layers:
        for param in layer.parameters():
            if param.is_floating_point():
                dtypes[param.dtype] += param.numel()  # the base weights, not the adapters
    dtype = dtypes.most_common(1)[0][0] if dtypes else None
    inputs = tuple(t.to(dtype) if dtype is not None and t.is_floating_point() else t
                   for t in inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), mode or contextlib.nullcontext():
        x = tuple(mode.from_tensor(t) for t in inputs) if mode else inputs
        for layer in layers:
            with FlopCounterMode(display=False) as counter:
                x = layer(x)
            flops.append(float(counter.get_total_flops()))
    if len(_COUNTED) >= 4:
        _COUNTED.pop(next(iter(_COUNTED)))
    _COUNTED[key] = tuple(flops)
    return flops


_COUNTED: dict[tuple, tuple[float, ...]] = {}  # the latest few `counted_layer_flops`


def model_params(module: nn.Module) -> int:
    """The module's parameters as the model-FLOP convention counts them: LoRA adapters left out."""
    return sum(p.numel() for n, p in module.named_parameters() if not is_adapter_param(n))


def attention_train_flops(seq: int, width: int, keys: int | None = None) -> float:
    """One attention call of `seq` queries over `keys` tokens (`seq` unless given: self-attention)
    of `width` (query heads x head dim), forward and backward: QK^T and AV, 2 matmuls of
    2*seq*keys*width FLOPs each, forward; backward twice that."""
    return 3 * 2 * 2 * seq * (seq if keys is None else keys) * width


def joint_attention_train_flops(denoiser: nn.Module, batch: int, seq: int, full: bool) -> float:
    """The benchmark's model-FLOP convention for a diffusers transformer of double- and
    single-stream blocks (config: num_layers, num_single_layers where it has them,
    num_attention_heads, attention_head_dim) whose every block attends over `seq` tokens:
    6 (full) or 4 (LoRA) x parameters x tokens, plus attention; LoRA adapters are not counted."""
    c = denoiser.config
    width = c.num_attention_heads * c.attention_head_dim
    blocks = c.num_layers + c.get("num_single_layers", 0)
    attention = attention_train_flops(seq, width) * blocks
    return batch * ((6 if full else 4) * model_params(denoiser) * seq + attention)


def replace_rows(target: torch.Tensor, values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of `target` whose samples `rows` (dim 0) are those of `values`."""
    out = target.clone()
    out[rows] = values[rows].to(out.dtype)
    return out
