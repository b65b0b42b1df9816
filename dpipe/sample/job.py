"""What `dpipe-sample` asks its workers to do, and one worker's part of it.

The command resolves everything a user can get wrong (the run dir, the export, the LoRA file,
the prompts) before any worker starts and saves the job in the folder the samples go to; each
worker then loads the denoiser with those weights the way users load them (diffusers' pipeline
`load_lora_weights`, or `from_pretrained` for a full fine-tune), keeps only its stage's layers,
and makes the round with `SampleRound`, as training does.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

JOB_FILE = "job.yaml"
log = logging.getLogger("dpipe")


@dataclass
class SampleJob:
    run_yaml: str  # the resolved RunConfig: model, stages, precision, sample.*
    weights: str  # "base", "lora" or "full"
    weights_dir: str | None  # the LoRA export folder or the full fine-tune's model folder
    folder: str  # where the samples and their index page go
    what: str  # the round's name in the log

    def save(self, job_dir: Path) -> None:
        from dpipe.io import atomic_write_text

        atomic_write_text(job_dir / JOB_FILE, OmegaConf.to_yaml(OmegaConf.structured(self)))

    @classmethod
    def load(cls, job_dir: Path) -> "SampleJob":
        return cls(**OmegaConf.to_container(OmegaConf.load(job_dir / JOB_FILE)))


def run_sampling(job: SampleJob) -> None:
    """This rank's part (RANK/WORLD_SIZE/MASTER_* already set)."""
    from dpipe.config.checks import validate
    from dpipe.config.schema import Precision
    from dpipe.data.prepare import prepare_prompts
    from dpipe.models.registry import build_spec
    from dpipe.pipeline.engine import start_rank
    from dpipe.pipeline.partition import stage_bounds
    from dpipe.sample.link import StageLink
    from dpipe.sample.requests import sample_requests
    from dpipe.sample.rounds import SampleRound

    run = validate(OmegaConf.create(job.run_yaml))
    device = start_rank(run)
    rank, world = dist.get_rank(), dist.get_world_size()
    bf16 = run.train.precision == Precision.bf16 and device.type == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32

    spec = build_spec(run.model)
    if rank == 0:
        spec.ensure_available()
    dist.barrier()
    requests = sample_requests(run.sample, spec, run.dataset)
    dataset = prepare_prompts(spec, run.dataset.cache_dir, device, dtype, requests)

    stages = run.pipeline.stages
    replicas = world // stages
    stage, replica = rank // replicas, rank % replicas  # DeepSpeed's pipe-major rank order
    groups = [dist.new_group([s * replicas + r for s in range(stages)]) for r in range(replicas)]
    host = dist.new_group(backend="gloo")
    link = StageLink([s * replicas + replica for s in range(stages)], stage, device,
                     groups[replica], host)

    torch.manual_seed(run.train.seed)  # whatever a family's loading draws: the same everywhere
    denoiser = _load_denoiser(spec, job)
    layers = spec.pipeline_layers(denoiser)
    bounds = stage_bounds(spec.layer_costs(layers), stages, run.pipeline.partition,
                          run.pipeline.split)
    local = layers[bounds[stage]:bounds[stage + 1]]
    for layer in layers:
        layer.to(device if any(layer is mine for mine in local) else "meta")
    del denoiser
    if rank == 0:
        log.info("sampling with %s weights on %d stage(s): %s", job.weights, stages,
                 ", ".join(f"stage {i}: layers {bounds[i]}-{bounds[i + 1] - 1}"
                           for i in range(stages)))
    cast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def forward(x):
        with cast:
            for layer in local:
                x = layer(x)
        return x

    sampling = spec.sampling()
    cfg = run.sample
    SampleRound(sampling, requests, dataset, link, replica, replicas,
                cfg.steps or sampling.default_steps,
                sampling.default_guidance if cfg.guidance is None else cfg.guidance,
                device, dtype, host, cfg.save_latents).run(
        forward, Path(job.folder), Path(job.folder), job.what)
    dist.barrier()


def _load_denoiser(spec, job: SampleJob):
    if job.weights == "lora" and _peft_only(Path(job.weights_dir)):
        from dpipe.models.adapters import load_adapter_file
        from dpipe.models.lora_files import DIFFUSERS_LORA

        denoiser = spec.load_denoiser(torch.float32)
        file = Path(job.weights_dir) / DIFFUSERS_LORA
        load_adapter_file(denoiser, file, _component(file))
    elif job.weights == "lora":
        denoiser = spec.load_denoiser_with_lora(Path(job.weights_dir))
    elif job.weights == "full":
        denoiser = spec.load_exported_full(Path(job.weights_dir))
    else:
        denoiser = spec.load_denoiser(torch.float32)
    return denoiser.requires_grad_(False).eval()


def _peft_only(lora_dir: Path) -> bool:
    """Whether the export holds a LoKr or LoHa: the families' pipelines load LoRA (and DoRA)
    keys only (diffusers reads LoKr through the transformer, LoHa not at all), so these go on
    the denoiser through peft."""
    from safetensors import safe_open

    from dpipe.config.schema import Adapter
    from dpipe.models.adapters import adapter_kind
    from dpipe.models.lora_files import DIFFUSERS_LORA

    with safe_open(str(lora_dir / DIFFUSERS_LORA), "pt") as f:
        return adapter_kind(f.keys()) in (Adapter.lokr, Adapter.loha)


def _component(file: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return next(iter(f.keys())).split(".", 1)[0]
