"""Typed schemas of the run config, one dataclass per config group.

These are registered in Hydra's ConfigStore (see `store.py`) as the base of every option file in
`conf/<group>/`, so an unknown key, a wrong type or a bad enum value fails at compose time with the
key's full name. Cross-field rules live in `checks.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, make_dataclass
from enum import Enum
from typing import Any, Optional, Union, get_type_hints

from omegaconf import MISSING


class TrainMode(str, Enum):
    lora = "lora"
    full = "full"


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class PartitionMethod(str, Enum):
    # Balance the model's per-layer cost: its measured or modelled time where the family gives
    # one (FLUX.1), else the parameter count (frozen ones included).
    balanced = "balanced"
    uniform = "uniform"  # the same number of layers per stage
    explicit = "explicit"  # `pipeline.split` gives the first layer of every stage after the first


class TimestepSampling(str, Enum):
    """How training draws t in (0, 1) (1: pure noise), before `train.timesteps.shift`."""

    uniform = "uniform"  # every noise level alike
    # sigmoid(N(logit_mean, logit_std)): most steps at mid noise (SD3's and diffusers' default)
    logit_normal = "logit_normal"
    sigmoid = "logit_normal"  # kohya's name for logit_normal
    # ... and its `shift` scheme's: logit_normal shifted by train.timesteps.shift (e.g. 3.0)
    shifted_sigmoid = "logit_normal"
    # diffusers' mode sampling: uniform bent by mode_scale (> 0: more mid noise, < 0: the ends)
    mode = "mode"
    cosmap = "cosmap"  # SD3's CosMap: t = 1 - 1/(tan(pi/2 u) + 1), slightly towards mid noise


class TimestepWeighting(str, Enum):
    """A per-sample loss weight from the noise level t: diffusers' SD3 loss weightings."""

    none = "none"  # every sample weighs 1: the default
    sigma_sqrt = "sigma_sqrt"  # 1 / t^2: favours low noise (fine detail); large near t = 0
    cosmap = "cosmap"  # 2 / (pi (1 - 2t + 2t^2)): CosMap's density as a weight, towards mid noise


class LrSchedule(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class OptimizerName(str, Enum):
    adamw = "adamw"  # torch's AdamW: the default
    adamw8bit = "adamw8bit"  # bitsandbytes' AdamW with 8-bit states: ~1/4 of AdamW's state memory
    adafactor = "adafactor"  # torch's Adafactor: factored second moments, no first moment
    came = "came"  # CAME (pytorch-optimizer): Adafactor-like memory, confidence-guided updates
    prodigy = "prodigy"  # Prodigy (prodigyopt): estimates the step size itself; optim.lr=1
    schedulefree_adamw = "schedulefree_adamw"  # schedulefree's AdamW: no learning-rate schedule
    muon = "muon"  # Muon (pytorch-optimizer) for matrices, AdamW for the 1-D parameters


class LossKind(str, Enum):
    mse = "mse"  # squared error: the default, what the models were trained with
    huber = "huber"  # squared below train.huber_delta, linear beyond: outliers pull less
    smooth_l1 = "smooth_l1"  # Huber divided by its threshold (train.smooth_l1_beta)


class LoggerName(str, Enum):
    tensorboard = "tensorboard"  # <run>/tensorboard: scalars and samples
    jsonl = "jsonl"  # <run>/metrics.jsonl: one line per logged step (always: summaries read it)
    wandb = "wandb"  # Weights & Biases: TensorBoard's scalars and samples, and the run config


class DatasetKind(str, Enum):
    synthetic = "synthetic"  # coloured shapes generated reproducibly into `path`
    folder = "folder"  # images and videos in `path` and/or `directories`


class MissingCaption(str, Enum):
    empty = "empty"  # train with an empty caption (the caption_prefix still applies)
    skip = "skip"  # leave the file out (listed in the dataset report)
    error = "error"  # refuse to start, listing the files


class AudioMissing(str, Enum):
    """Clips without sound (no audio track, no same-stem .wav/.flac) when the model trains on
    audio (model.audio=true)."""

    error = "error"  # refuse to start, listing the clips
    silence = "silence"  # train them on silence (listed in the dataset report)
    skip = "skip"  # leave them out (listed in the dataset report)


class ClipSelection(str, Enum):
    beginning = "beginning"  # one clip from the first frame
    middle = "middle"  # one clip centred in the video
    multiple = "multiple"  # `clips_per_video` clips spread evenly over the video


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: Optional[float] = None  # None: alpha = rank (scale 1)
    dropout: float = 0.0
    # Module names (peft `target_modules`); None uses the family's default targets.
    targets: Optional[list[str]] = None
    # An adapter file to start from instead of the adapter's fresh init: a file (or an export
    # folder: its pytorch_lora_weights.safetensors) of the same adapter, rank and targets, in any
    # format dpipe.models.lora_read reads (diffusers, peft, ComfyUI, kohya, ai-toolkit, LyCORIS);
    # its scale is refolded to this run's alpha. null: a fresh adapter.
    init_from: Optional[str] = None


class Adapter(str, Enum):
    """What model.mode=lora trains on each target Linear (peft's tuners), all sized by
    model.lora.rank / alpha / dropout / targets."""

    lora = "lora"  # B @ A: the default, read by every loader
    lokr = "lokr"  # LyCORIS LoKr: a Kronecker product, far fewer weights at a given rank
    loha = "loha"  # LyCORIS LoHa: a Hadamard product of two low-rank products (rank r^2)
    dora = "dora"  # LoRA with a learned magnitude per output row (weight-decomposed)


class BaseDtype(str, Enum):
    auto = "auto"  # the training precision: bf16 under train.precision=bf16, else fp32
    # LoRA only: the blocks' frozen Linear weights stored in 8 bits with a scale per output row,
    # upcast to the compute dtype inside each Linear (half of bf16's memory; dpipe.train.fp8).
    # float8_e4m3fn (3 mantissa bits): the default choice, and the format of most fp8 files.
    fp8 = "fp8"
    # float8_e5m2 (2 mantissa bits, more range): coarser than e4m3 (twice its Linear error on
    # the tiny model); for a base that will run in e5m2 at inference.
    fp8_e5m2 = "fp8_e5m2"
    # int8 (uniform steps of a row's largest weight / 127): closer to bf16 than e4m3 where rows
    # have no outliers (a sixth of e4m3's Linear error on the tiny model's weights), coarser for
    # the small weights of a row with one large outlier.
    int8 = "int8"
    # bitsandbytes' storages, QLoRA-style (dpipe.train.bnb_base), quantized by bitsandbytes' own
    # functions: 4-bit NormalFloat with an fp32 absmax per 64 values (0.56 bytes a value, a
    # quarter of bf16 plus the absmax), and LLM.int8()'s int8 rows with a scale per row.
    nf4 = "nf4"
    int8_bnb = "int8_bnb"

    @property
    def quantized(self) -> bool:
        return self is not BaseDtype.auto


class BaseCompute(str, Enum):
    auto = "auto"  # the frozen base multiplies in the training precision (bf16, or fp32)
    # LoRA only: the blocks' frozen Linears multiply in fp8 (torch._scaled_mm): weights stored as
    # model.base_dtype=fp8 stores them, activations quantised per token row on the fly, the
    # input gradient in fp8 too (dpipe.train.fp8_compute). About twice the bf16 matmul rate on
    # GPUs of compute capability 8.9+ (Ada, Hopper); elsewhere the run says why and multiplies
    # in bf16 from the same fp8 weights. On a quantized single file, the Linears it stores in
    # float8_e4m3fn (int8 for int8) multiply its own bytes (dpipe.train.fp8.stored_as).
    fp8 = "fp8"
    # LoRA only: the same in int8 (W8A8, torch._int_mm, the product rescaled in fp32): weights
    # stored as model.base_dtype=int8 stores them, activations and the input gradient quantised
    # per row to int8 (dpipe.train.int8_compute). For GPUs with int8 tensor cores and no fp8
    # matmul: Ampere (A100, RTX 30xx), compute capability 8.0+; elsewhere as fp8's.
    int8 = "int8"


class AttentionKernel(str, Enum):
    # The default: cudnn for LoRAs on the GPUs where its kernel has been checked in training
    # (compute capability 9.0: H100, H200; dpipe.pipeline.attention.CUDNN_CHECKED), sdpa for full
    # fine-tunes and elsewhere (other GPUs, the CPU). Runs log the kernel it chose.
    auto = "auto"
    # PyTorch's scaled_dot_product_attention, diffusers' default, without cuDNN's kernel: flash,
    # or the memory-efficient kernel under a mask (the text padding of HunyuanVideo,
    # Qwen-Image, LTX-Video...), which took 2.5x flash's time on an H200.
    sdpa = "sdpa"
    # GPU only: SDPA with cuDNN's kernel first (flash, then memory-efficient where it cannot
    # run a call). On an H200 its forward and backward ran at 2x flash's speed at FLUX.1-dev's,
    # Qwen-Image's and HunyuanVideo 1.5's shapes and FLUX.1-dev's LoRA step took 3.13 s instead
    # of 3.73 (docs/performance.md). Every tiny family's LoRA trains with it eager, and 20 of
    # 22 compiled, to sdpa's losses on an H200 (tests/gpu, since dpipe.pipeline.attention fixed the
    # layout its backward needs). Compiled, a tiny full fine-tune went NaN with it; other GPUs
    # are unchecked: hence `auto`'s rule.
    cudnn = "cudnn"
    # FlexAttention, built for masks; on a GPU with pipeline.compile=true. Alone it ran that
    # masked attention 2.6x as fast, but inside a compiled 13B block its compile took minutes
    # (docs/performance.md, "HunyuanVideo 13B on one H200"): experimental, not the default.
    flex = "flex"


@dataclass
class ModelConfig:
    family: str = MISSING  # a name in dpipe.models.registry, e.g. "flux"
    path: str = MISSING  # a diffusers-format folder (FLUX.1-dev layout for flux)
    # Create a tiny random model at `path` if it does not exist (for demos and tests).
    tiny: bool = False
    mode: TrainMode = TrainMode.lora
    lora: LoraConfig = field(default_factory=LoraConfig)
    # The adapter model.mode=lora trains (see Adapter): lora, lokr, loha or dora.
    adapter: Adapter = Adapter.lora
    # LoKr only (peft's decompose_factor): the size of the Kronecker product's first factor;
    # -1 splits each weight as squarely as it divides. Set it (e.g. 8) for fewer, larger blocks.
    lokr_factor: int = -1
    # Adapter files (any format dpipe.models.lora_read reads) merged into the frozen base
    # weights before training, in order, and before bf16 or model.base_dtype=fp8 round them:
    # the trained adapter learns on top of them.
    merge_adapters: list[str] = field(default_factory=list)
    # How the frozen base weights are stored under LoRA: auto, fp8, fp8_e5m2, int8, nf4 or
    # int8_bnb (BaseDtype).
    base_dtype: BaseDtype = BaseDtype.auto
    # How the frozen base weights multiply under LoRA: auto, fp8 or int8 (BaseCompute).
    base_compute: BaseCompute = BaseCompute.auto
    # Guidance value fed to guidance-distilled models (FLUX.1-dev) during training.
    guidance: float = 1.0
    # Longest text-encoder sequence (T5 tokens for Flux).
    max_text_tokens: int = 512
    # The range of t (0: clean, 1: noise) this model trains on: sampled t is mapped linearly into
    # [min_t, max_t]. Wan 2.2 A14B trains each expert on its own range (e.g. min_t=0.875: the
    # high-noise expert). Only families that support it accept a range other than [0, 1].
    min_t: float = 0.0
    max_t: float = 1.0
    # Condition on the first frame (image-to-video). null: the checkpoint's own task (i2v for
    # image-to-video checkpoints); true/false where a checkpoint does both (Wan 2.2 TI2V-5B).
    i2v: Optional[bool] = None
    # Noise-prediction models (SDXL): what the denoiser predicts, "epsilon" or "v_prediction".
    # null: the checkpoint's own (its scheduler config's prediction_type).
    prediction_type: Optional[str] = None
    # Noise-prediction models (SDXL): min-SNR-gamma loss weighting (5.0 is the usual gamma); 0: off.
    min_snr_gamma: float = 0.0
    # Noise-prediction models (SDXL): debiased estimation, the loss weighed by 1/sqrt(SNR)
    # (Yu et al. 2023; with min_snr_gamma, both weights multiply).
    debiased_estimation: bool = False
    # With `path` naming a single-file checkpoint (.safetensors, as SDXL fine-tunes are shared):
    # a diffusers folder or hub id holding the matching configs and tokenizers. null: diffusers'
    # default for the checkpoint's type (fetched from the hub once, then from its cache).
    # Families whose single files are read for the transformer only (Wan, HunyuanVideo,
    # LTX-Video, LTX-2, Cosmos-Predict2, Z-Image, Qwen-Image, Lumina 2, FLUX.1 / Kontext / FLUX.2,
    # SD3, Chroma, HiDream-I1, AuraFlow): the diffusers folder of the same model, required, for
    # the VAE, text encoders, tokenizers and configs.
    single_file_config: Optional[str] = None
    # The attention kernel (see AttentionKernel): auto, sdpa, cudnn or flex.
    attention: AttentionKernel = AttentionKernel.auto
    # Audio-video families (LTX-2, LTX-2.3, MiniMax H3): train the joint computation on clips'
    # sound (the audio stream and both cross-modal attentions) as inference runs it. false: the
    # video stream only. Families without audio refuse true.
    audio: bool = False
    # With model.audio=true: the loss is video loss + audio_loss_weight * audio loss.
    audio_loss_weight: float = 1.0


@dataclass
class DataSettings:
    """How the files of a directory become training samples. Set on the dataset, these apply to
    every directory; each entry of `directories` may override any of them."""

    # Target areas, as the side of a square of that area: 512 -> about 512*512 pixels, whatever
    # the aspect ratio. Every file is trained at each listed resolution.
    resolutions: list[int] = field(default_factory=lambda: [512])
    # Aspect-ratio buckets (width / height). An explicit list, e.g. [0.75, 1.0, 1.333]; or, when
    # null, `num_aspect_buckets` ratios spaced evenly in log scale from min to max (1: square only).
    aspect_ratios: Optional[list[float]] = None
    min_aspect_ratio: float = 0.5
    max_aspect_ratio: float = 2.0
    num_aspect_buckets: int = 7
    # Frame counts of video buckets; a clip goes to the longest bucket it fills. Images have 1.
    # null: [1, N] chosen from a directory's clips (dpipe.data.buckets.frames_from_clips), so a
    # folder of clips trains as clips; the dataset report says what was chosen.
    frame_buckets: Optional[list[int]] = None
    clip_selection: ClipSelection = ClipSelection.beginning
    clips_per_video: int = 3  # with clip_selection=multiple
    video_fps: Optional[float] = None  # resample videos to this frame rate; null keeps theirs
    # With model.audio=true: what a clip with no audio track and no same-stem .wav/.flac gets.
    audio_missing: AudioMissing = AudioMissing.error
    num_repeats: int = 1  # each file counts this many times per epoch
    # A JSON ({"cat.jpg": "a cat"} or {"cat.jpg": ["a cat", "a tabby"]}) or JSONL file
    # ({"file": "cat.jpg", "caption": ...} per line) of captions, relative to the directory.
    # Files it does not name fall back to a same-stem .txt (cat.jpg -> cat.txt).
    captions_file: Optional[str] = None
    caption_prefix: str = ""  # put before every caption, e.g. a trigger word "sks style, "
    missing_caption: MissingCaption = MissingCaption.error
    # Shuffle comma-separated tags: `tag_variants` shuffled captions are cached per caption and
    # one is drawn each time the file is used; the first `keep_tags` tags stay in place.
    shuffle_tags: bool = False
    tag_variants: int = 4
    keep_tags: int = 0
    tag_separator: str = ","
    caption_dropout: float = 0.0  # probability of training a sample on the empty caption
    # Same-stem files (any image format) weighting the loss per pixel: white 1, black 0.
    mask_dir: Optional[str] = None
    # Same-stem control/reference images (edit models), cached and delivered with each sample;
    # several per file as <stem>_1, <stem>_2, ... (families that take several references).
    control_dir: Optional[str] = None
    # Video families with frame conditioning (`conditioning`): a same-stem image per clip that
    # is its first (last) frame, in place of the clip's own, for the condition and the clip.
    first_frame_dir: Optional[str] = None
    last_frame_dir: Optional[str] = None
    # Each sample's loss counts this many times: e.g. 0.5 for a regularisation directory, so it
    # steers less than the subject's own images.
    loss_weight: float = 1.0
    # Prior preservation (LoRA only): these files train towards the base model's own prediction
    # (the adapters switched off, same noise and timestep) instead of the data, so the LoRA
    # learns to leave such images as the base model makes them. Costs one extra forward pass
    # (no backward) per micro-batch that holds such a file.
    prior_preservation: bool = False

    def __post_init__(self):
        _check_settings(self, "dataset")


def _check_settings(s, where: str) -> None:
    """Value checks of DataSettings fields; `None` (inherit) is always fine."""
    from dpipe.errors import ConfigError

    def bad(key, value, need):
        raise ConfigError(f"{where}.{key}={value!r}: {need}")

    for key in ("resolutions", "frame_buckets"):
        values = getattr(s, key)
        if values is not None and (not values or any(v < 1 for v in values)):
            bad(key, values, "give one or more whole numbers >= 1")
    if s.aspect_ratios is not None and (not s.aspect_ratios or min(s.aspect_ratios) <= 0):
        bad("aspect_ratios", s.aspect_ratios, "give one or more ratios > 0, or null")
    lo, hi = s.min_aspect_ratio, s.max_aspect_ratio
    if lo is not None and lo <= 0 or hi is not None and hi <= 0:
        bad("min_aspect_ratio/max_aspect_ratio", (lo, hi), "must be > 0")
    if lo is not None and hi is not None and lo > hi:
        bad("min_aspect_ratio", lo, f"must not exceed max_aspect_ratio={hi}")
    for key in ("num_aspect_buckets", "clips_per_video", "num_repeats", "tag_variants"):
        value = getattr(s, key)
        if value is not None and value < 1:
            bad(key, value, "must be >= 1")
    if s.keep_tags is not None and s.keep_tags < 0:
        bad("keep_tags", s.keep_tags, "must be >= 0")
    if s.video_fps is not None and s.video_fps <= 0:
        bad("video_fps", s.video_fps, "must be > 0, or null to keep each video's own rate")
    if s.caption_dropout is not None and not 0 <= s.caption_dropout < 1:
        bad("caption_dropout", s.caption_dropout, "must be in [0, 1)")
    if s.tag_separator is not None and not s.tag_separator.strip():
        bad("tag_separator", s.tag_separator, "must contain a visible character")
    if s.loss_weight is not None and not (math.isfinite(s.loss_weight) and s.loss_weight > 0):
        bad("loss_weight", s.loss_weight, "must be a number > 0 (1: the usual weight)")


def _directory_post_init(self):
    from dpipe.errors import ConfigError

    if not self.path:
        raise ConfigError("every entry of dataset.directories needs a `path`")
    _check_settings(self, f"dataset.directories[path={self.path}]")


_SETTINGS_HINTS = get_type_hints(DataSettings)
# A directory: a `path` plus any DataSettings field to override (null: the dataset's value).
# Generated from DataSettings so the two can never drift apart.
DirectoryConfig = make_dataclass(
    "DirectoryConfig",
    [("path", str, MISSING)]
    + [(f.name, Optional[_SETTINGS_HINTS[f.name]], None) for f in fields(DataSettings)],
    namespace={"__post_init__": _directory_post_init, "__module__": __name__,
               "__doc__": "A dataset directory: `path` and any DataSettings to override."},
)


@dataclass
class BucketBatchSize:
    """Micro-batch size of the buckets of one resolution (and frame count)."""

    resolution: int = MISSING
    frames: Optional[int] = None  # null: every frame count
    micro_batch_size: int = MISSING


@dataclass
class EvalSetConfig:
    name: str = MISSING  # TensorBoard tag: eval/<name>/...
    # Directories inheriting the dataset's settings (repeats, tag shuffling and caption dropout
    # are not applied: eval sees each file once with its first caption).
    directories: list[DirectoryConfig] = field(default_factory=list)  # type: ignore[valid-type]


@dataclass
class ConditioningConfig:
    """Video families: the probability that a training sample conditions on its first frame,
    its last frame, both or none (drawn per sample and step from train.seed). All null: the
    checkpoint's own task (text-to-video: none, image-to-video: first, first-last-frame: both);
    given ones must sum to 1, and the ones left null are 0."""
    first: Optional[float] = None
    last: Optional[float] = None
    both: Optional[float] = None
    none: Optional[float] = None


@dataclass
class EvalConfig:
    every_steps: int = 0  # 0: no eval during training
    before_training: bool = True  # also at the run's first step (a baseline)
    # Eval loss is measured at these quantiles of the training timestep distribution, each with
    # fixed noise, so successive evals differ only by the model.
    quantiles: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    sets: list[EvalSetConfig] = field(default_factory=list)


@dataclass
class DatasetConfig(DataSettings):
    kind: DatasetKind = DatasetKind.folder
    # A single directory (for `synthetic`: where the images are generated). Use `directories`
    # for several, or to override settings per directory; both may be given.
    path: Optional[str] = None
    directories: list[DirectoryConfig] = field(default_factory=list)  # type: ignore[valid-type]
    num_images: int = 16  # `synthetic` only: how many images to generate
    # Per-bucket micro-batch sizes; buckets not listed use pipeline.micro_batch_size.
    micro_batch_sizes: list[BucketBatchSize] = field(default_factory=list)
    # Unreadable image/video files: false skips them with a warning listing them; true refuses.
    strict: bool = False
    # Where cached latents and text embeddings go; outside the dataset so read-only data works.
    cache_dir: str = "${oc.env:DPIPE_CACHE,${oc.env:HOME}/.cache/dpipe}/latents"
    cache_workers: Optional[int] = None  # processes decoding files for the cache; null: auto
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Write every rank's micro-batches (step, bucket, files) to <run_dir>/data/batches-rank*.jsonl.
    log_batches: bool = False
    # Video families: which frames each sample conditions on (first/last/both/none).
    conditioning: ConditioningConfig = field(default_factory=ConditioningConfig)

    def __post_init__(self):
        from dpipe.errors import ConfigError

        super().__post_init__()
        if self.path is None and not self.directories:
            raise ConfigError("the dataset has no files: set dataset.path or dataset.directories")
        if self.kind == DatasetKind.synthetic and self.path is None:
            raise ConfigError("dataset.kind=synthetic needs dataset.path (where to draw images)")
        for rule in self.micro_batch_sizes:
            if rule.micro_batch_size < 1:
                raise ConfigError(f"dataset.micro_batch_sizes: {rule} needs micro_batch_size >= 1")
        e = self.eval
        if e.every_steps < 0 or not e.quantiles or not all(0 < q < 1 for q in e.quantiles):
            raise ConfigError(
                f"dataset.eval: every_steps must be >= 0 and quantiles in (0, 1), got "
                f"{e.every_steps} and {e.quantiles}")
        names = [s.name for s in e.sets]
        if len(set(names)) != len(names) or any(not s.directories for s in e.sets):
            raise ConfigError(f"dataset.eval.sets: names must differ and each needs directories "
                              f"(got {names})")
        if e.every_steps and not e.sets:
            raise ConfigError("dataset.eval.every_steps is set but dataset.eval.sets is empty")

    @property
    def resolution(self) -> int:
        """The largest target resolution (synthetic images are drawn at this size)."""
        return max(self.resolutions)


@dataclass
class ParamGroupConfig:
    """Trainable parameters with their own learning rate or weight decay (optim.param_groups)."""
    # A regular expression searched in each trainable parameter's name, as the diffusers model
    # names it ("transformer_blocks.3.attn.to_q.lora_B.default.weight"); the first group whose
    # pattern matches takes the parameter, the rest keep the optimizer's values.
    match: str = MISSING
    lr: Optional[float] = None  # null: optim.lr
    weight_decay: Optional[float] = None  # null: optim.weight_decay (1-D parameters: none)


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01
    eps: float = 1e-8
    schedule: LrSchedule = LrSchedule.constant
    warmup_steps: int = 0
    grad_clip: float = 1.0  # 0 disables clipping
    # bf16 full fine-tunes: keep fp32 master weights and optimizer states (DeepSpeed's bf16
    # optimizer, ~16 bytes per parameter); false trains the bf16 weights directly with AdamW
    # states in bf16 (~8 bytes per parameter, as most trainers do), when memory is short.
    master_weights: bool = True
    # Weight decay on the 1-D parameters (norm scales, biases) too. False, the default, decays
    # only the matrices, as most trainers do: decay pulls a norm's scale towards 0, not 1.
    weight_decay_1d: bool = False
    # e.g. [{match: lora_B, lr: 1.6e-3}] (LoRA+: the B matrices at 16x the rate), or a text
    # adapter's own rate; schedule and warm-up scale every group alike.
    param_groups: list[ParamGroupConfig] = field(default_factory=list)
    # The keys below belong to one optimizer each (conf/optim/<name>.yaml sets them); `betas`
    # is two numbers, three for came.
    # adamw8bit: tensors with fewer elements keep 32-bit states (bitsandbytes' default, 4096).
    min_8bit_size: int = 4096
    # adafactor, came: the update's RMS is clipped to this (Adafactor's d).
    clip_threshold: float = 1.0
    # adafactor: the second moment decays with beta2_t = 1 - t^beta2_decay.
    beta2_decay: float = -0.8
    # prodigy: the first step-size estimate and a multiplier of every estimate; safeguard_warmup
    # keeps the estimate from growing in warm-up (recommended with optim.warmup_steps).
    d0: float = 1e-6
    d_coef: float = 1.0
    safeguard_warmup: bool = False
    use_bias_correction: bool = False
    # schedulefree_adamw: the averaging weights grow as lr^weight_lr_power * t^r; its warm-up is
    # optim.warmup_steps, inside the optimizer (optim.schedule must be constant).
    r: float = 0.0
    weight_lr_power: float = 2.0
    # muon: momentum and Newton-Schulz steps for the matrices; the 1-D parameters train with
    # AdamW at muon_adamw_lr with optim.betas and optim.eps.
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    muon_adamw_lr: float = 3e-4


@dataclass
class PipelineConfig:
    # pipeline=auto: on GPUs, the plan (dpipe.plan; `dpipe-train --plan` prints it) sets
    # stages, data_parallel, model.base_dtype, activation_checkpointing, memory_budget_gb and
    # blocks_to_swap for the GPUs there are, keeping any of them set on the command line; on a
    # CPU the keys below run as they are (two stages), or the plan for `machine` where it is set.
    auto: bool = False
    # The machine the plan is for where no GPU is visible, as `dpipe-train --plan --machine`
    # takes it: "NxG[,host=H][,disk=D]" (N GPUs of G GiB, H GiB of host memory, default 64).
    # An experiment preset names the machine it targets so: `--plan` on a laptop or a login
    # node prints the plan the preset runs there, and dpipe-train with pipeline=auto on a
    # machine without GPUs applies it (the same stages and base storage, on CPU processes).
    # The GPUs a run sees win over it (torchrun and SLURM ranks plan for the GPUs they were
    # started on), and so does `--machine`; null: plan for visible GPUs only.
    machine: Optional[str] = None
    stages: int = 1
    # Data-parallel replicas of the whole pipeline; None: all the GPUs (1 on CPU).
    data_parallel: Optional[int] = None
    micro_batch_size: int = 1
    # Micro-batches per optimizer step (gradient accumulation); the pipeline interleaves them.
    micro_batches: int = 1
    partition: PartitionMethod = PartitionMethod.balanced
    split: Optional[list[int]] = None  # with partition=explicit
    # Which layers recompute their activations in backward instead of keeping them:
    # "none", "all", "auto" (as few as the GPU memory budget needs; none on CPU), a number N
    # (the first N blocks of each stage), or "offload" (every layer, its input kept in pinned
    # host memory until the recompute instead of on the GPU).
    activation_checkpointing: str = "none"
    # GPU memory that "auto" plans for, in GiB; null: 92% of the device's memory.
    memory_budget_gb: Optional[float] = None
    # Block swap: the frozen weights of this many layers of each stage (the first N that hold
    # frozen weights) live in pinned host memory and are copied to the GPU one layer ahead of
    # their use, in forward and backward; trainable weights (LoRA) stay on the GPU. "auto" (with
    # activation_checkpointing=auto): the memory plan chooses, per layer, between swapping and
    # recomputing. LoRA and other adapters only. On the CPU it copies between host tensors (no
    # memory saved; auto swaps nothing there).
    blocks_to_swap: str = "0"
    # torch.compile each pipeline layer (each transformer block): ~1.3-1.5x faster on GPU after a
    # one-off compile of about a minute (FLUX.1-dev's LoRA step 1.48x on an H200; every tiny
    # family trains compiled there, tests/gpu). null, the default: on a GPU, off on the CPU,
    # where compiling a step outlasts the training of a small test run (`compiles`).
    compile: Optional[bool] = None
    zero_stage: int = 0

    @property
    def compiles(self) -> bool:
        """Whether this process compiles its layers: `compile`, or on a GPU where it is null (one
        that inductor's Triton kernels run on: compute capability 7.0 or later)."""
        import torch  # here, not at the top: the config loads without torch elsewhere

        if self.compile is not None:
            return self.compile
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (7, 0)


SHIFT_AUTO = "auto"  # train.timesteps.shift's keyword


@dataclass
class TimestepConfig:
    sampling: TimestepSampling = TimestepSampling.logit_normal
    logit_mean: float = 0.0
    logit_std: float = 1.0
    # sampling=mode: diffusers' default 1.29; 0 is uniform; in [-1, 2/(pi-2)] (t stays in (0, 1))
    mode_scale: float = 1.29
    # t' = shift*t / (1 + (shift-1)*t); 1 disables. "auto": the shift the family's sampler
    # applies at each micro-batch's resolution (FLUX's from its token count; else the
    # scheduler's fixed shift). omegaconf keeps `shift=3` an int and `shift=auto` a str;
    # `checks.py` refuses any other word.
    shift: Union[float, int, str] = 1.0
    weighting: TimestepWeighting = TimestepWeighting.none

    @property
    def auto_shift(self) -> bool:
        return self.shift == SHIFT_AUTO

    @property
    def fixed_shift(self) -> float:
        """The number `shift` gives (not for `auto`, which each micro-batch resolves)."""
        if self.auto_shift:
            raise ValueError("train.timesteps.shift=auto has no fixed value")
        return float(self.shift)


@dataclass
class EmaConfig:
    """An exponential moving average of the trainable weights (dpipe.train.ema), kept per
    pipeline stage, saved in checkpoints and exported to `<export>/ema/` beside the weights."""

    decay: float = 0.0  # 0: no EMA; e.g. 0.999 averages over about the last 1000 updates
    cpu: bool = False  # keep it in host memory: no GPU memory, a copy to the host per update
    every_steps: int = 1  # update it every N steps (the decay applies per update)
    # The decay of update k is min(decay, (1 + k) / (10 + k)): early on the average follows
    # the weights instead of staying near where they started. false: `decay` from the first.
    warmup: bool = True


@dataclass
class WandbConfig:
    """train.loggers=[tensorboard, jsonl, wandb]: where the wandb run goes. `mode` offline keeps
    it in <run>/wandb/ (`wandb sync` uploads it later); null: WANDB_MODE, else online."""
    project: str = "dpipe"
    entity: Optional[str] = None
    name: Optional[str] = None  # null: the run dir's name
    tags: list[str] = field(default_factory=list)
    mode: Optional[str] = None  # online, offline or null


@dataclass
class TrainConfig:
    max_steps: int = 100
    seed: int = 42
    precision: Precision = Precision.fp32
    timesteps: TimestepConfig = field(default_factory=TimestepConfig)
    # The error per element between prediction and target (dpipe.diffusion.loss), weighted by the
    # dataset's masks in every family.
    loss: LossKind = LossKind.mse
    huber_delta: float = 1.0  # train.loss=huber: where the error turns from squared to linear
    smooth_l1_beta: float = 1.0  # train.loss=smooth_l1: the same threshold
    log_every: int = 1
    # Where rank 0 logs: TensorBoard and metrics.jsonl by default; add wandb (train.wandb.*).
    loggers: list[LoggerName] = field(
        default_factory=lambda: [LoggerName.tensorboard, LoggerName.jsonl])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    checkpoint_every_steps: int = 50  # 0 disables step-based checkpoints
    checkpoint_every_minutes: float = 0.0  # 0 disables time-based checkpoints
    keep_checkpoints: int = 2
    export_every_steps: int = 0  # also export to <run>/lora/step_<N>/ every N steps; 0: at the end
    keep_exports: int = 0  # how many of the newest step_<N>/ exports to keep; 0: all
    resume: bool = True  # continue from the newest complete checkpoint in the run dir
    # Also from a checkpoint whose COMPLETE lists no files to verify them by (an older dpipe's):
    # its weights may have been changed; its pickles are read without running code either way.
    resume_unverified: bool = False
    progress_bar: bool = True
    # Processes per rank that prepare the coming steps' micro-batches (cache reads, noise,
    # input packing) while the current step trains; 0: in the training process, as each
    # micro-batch is needed. null: 2 on GPU, 0 on CPU. Never changes what is trained on.
    loader_workers: Optional[int] = None
    # The step whose stalls are counted on every rank and recorded with its metrics: host syncs
    # (each drains the GPU's queue) and autograd passes per micro-batch (1 is the minimum).
    # The second step by default: the first compiles and measures. 0 turns the count off.
    audit_step: int = 2
    ema: EmaConfig = field(default_factory=EmaConfig)


# The keys a `sample.prompts` item may set besides `prompt` (dpipe.sample.requests checks them).
PROMPT_KEYS = ("prompt", "negative_prompt", "seed", "width", "height", "frames", "control",
               "first_frame", "last_frame", "audio_guidance")


@dataclass
class SampleConfig:
    """Samples made while training (through the training processes' own pipeline stages) and by
    `dpipe-sample`. With no prompts nothing is sampled and nothing is loaded for it."""

    # Each item a prompt, or a mapping with `prompt` and any of negative_prompt, seed, width,
    # height, frames, control (an image path, for edit and image-to-video families; a list of
    # paths, in order, for families that take several references), audio_guidance.
    prompts: list[Any] = field(default_factory=list)
    # A text file of prompts, one per line (blank lines and lines starting with # skipped),
    # sampled after the items of `prompts`: prompts with commas need no quoting there.
    prompts_file: Optional[str] = None
    every_steps: int = 0  # sample every N steps; 0: only at the end of training
    at_start: bool = False  # also before the first step (a baseline to compare with)
    steps: Optional[int] = None  # denoising steps; null: the family's usual number
    guidance: Optional[float] = None  # guidance scale; null: the family's usual value
    # The sound's own guidance scale, for families that guide it apart from the picture (LTX-2
    # and LTX-2.3 with model.audio=true); null: the family's usual value (LTX2Pipeline's 7.0).
    audio_guidance: Optional[float] = None
    seed: int = 0  # the noise seed of items without their own
    negative_prompt: str = ""  # for families with classifier-free guidance
    # Sizes of items without their own; null: the dataset's largest resolution, square, and
    # for video families its longest frame bucket (1 frame: an image; also while
    # dataset.frame_buckets is null, as the workers choose those from the clips).
    width: Optional[int] = None
    height: Optional[int] = None
    frames: Optional[int] = None
    # Also write each sample's final latents (<k>.safetensors beside <k>.png), to decode them
    # elsewhere or compare runs exactly.
    save_latents: bool = False
    # Sample with the EMA of the weights (train.ema.decay > 0) instead of the weights themselves;
    # `dpipe-sample run=...` then samples from the export's ema/ folder.
    ema: bool = False


@dataclass
class RunConfig:
    name: str = "default"
    model: ModelConfig = MISSING
    dataset: DatasetConfig = MISSING
    optim: OptimConfig = MISSING
    pipeline: PipelineConfig = MISSING
    train: TrainConfig = MISSING
    sample: SampleConfig = field(default_factory=SampleConfig)
