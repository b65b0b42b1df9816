"""Typed schemas of the run config, one dataclass per config group.

These are registered in Hydra's ConfigStore (see `store.py`) as the base of every option file in
`conf/<group>/`, so an unknown key, a wrong type or a bad enum value fails at compose time with the
key's full name. Cross-field rules live in `checks.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING


class TrainMode(str, Enum):
    lora = "lora"
    full = "full"


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class PartitionMethod(str, Enum):
    parameters = "parameters"  # balance the number of parameters (frozen ones included)
    uniform = "uniform"  # the same number of layers per stage
    explicit = "explicit"  # `pipeline.split` gives the first layer of every stage after the first


class TimestepSampling(str, Enum):
    uniform = "uniform"
    logit_normal = "logit_normal"


class LrSchedule(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class OptimizerName(str, Enum):
    adamw = "adamw"


class DatasetKind(str, Enum):
    synthetic = "synthetic"  # coloured shapes generated reproducibly into `path`
    folder = "folder"  # images with same-stem .txt captions


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: Optional[float] = None  # None: alpha = rank (scale 1)
    dropout: float = 0.0
    # Module names (peft `target_modules`); None uses the family's default targets.
    targets: Optional[list[str]] = None


@dataclass
class ModelConfig:
    family: str = MISSING  # a name in dpipe.models.registry, e.g. "flux"
    path: str = MISSING  # a diffusers-format folder (FLUX.1-dev layout for flux)
    # Create a tiny random model at `path` if it does not exist (for demos and tests).
    tiny: bool = False
    mode: TrainMode = TrainMode.lora
    lora: LoraConfig = field(default_factory=LoraConfig)
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


@dataclass
class DatasetConfig:
    kind: DatasetKind = MISSING
    path: str = MISSING  # image folder (for `synthetic`: where the images are generated)
    resolution: int = 512  # images are resized and centre-cropped to resolution x resolution
    num_images: int = 16  # `synthetic` only: how many images to generate
    # Where cached latents and text embeddings go; outside the dataset so read-only data works.
    cache_dir: str = "${oc.env:DPIPE_CACHE,${oc.env:HOME}/.cache/dpipe}/latents"


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


@dataclass
class PipelineConfig:
    stages: int = 1
    # Data-parallel replicas of the whole pipeline; None: all the GPUs (1 on CPU).
    data_parallel: Optional[int] = None
    micro_batch_size: int = 1
    # Micro-batches per optimizer step (gradient accumulation); the pipeline interleaves them.
    micro_batches: int = 1
    partition: PartitionMethod = PartitionMethod.parameters
    split: Optional[list[int]] = None  # with partition=explicit
    # Recompute every N-th layer group's activations in backward (0: keep all activations).
    activation_checkpoint_interval: int = 0
    zero_stage: int = 0


@dataclass
class TimestepConfig:
    sampling: TimestepSampling = TimestepSampling.logit_normal
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0  # t' = shift*t / (1 + (shift-1)*t); 1 disables


@dataclass
class TrainConfig:
    max_steps: int = 100
    seed: int = 42
    precision: Precision = Precision.fp32
    timesteps: TimestepConfig = field(default_factory=TimestepConfig)
    log_every: int = 1
    checkpoint_every_steps: int = 50  # 0 disables step-based checkpoints
    checkpoint_every_minutes: float = 0.0  # 0 disables time-based checkpoints
    keep_checkpoints: int = 2
    resume: bool = True  # continue from the newest complete checkpoint in the run dir
    progress_bar: bool = True


@dataclass
class RunConfig:
    name: str = "default"
    model: ModelConfig = MISSING
    dataset: DatasetConfig = MISSING
    optim: OptimConfig = MISSING
    pipeline: PipelineConfig = MISSING
    train: TrainConfig = MISSING
