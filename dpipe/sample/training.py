"""Samples while a run trains, made by the training processes through their own stages.

No rank ever holds more of the denoiser than its stage: each round runs forward-only through the
pipeline engine's layers as they stand (`SampleRound`). The prompts were encoded with the
captions, into the same cache. A round runs after its step's checkpoint, so it never costs one,
and a failed sample is logged while training goes on.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dpipe.data.batches import CachedDataset
from dpipe.models.sampling import SampleRequest
from dpipe.sample.link import StageLink
from dpipe.sample.rounds import SampleRound

SAMPLES_DIR = "samples"


def round_dir(run_dir: Path, step: int) -> Path:
    return run_dir / SAMPLES_DIR / f"step_{step}"


class TrainingSamples:
    """Collective: every rank builds one and calls `run` / `missing` at the same steps."""

    def __init__(self, spec, run, requests: list[SampleRequest], run_dir: Path,
                 dataset: CachedDataset, engine, device: torch.device, dtype: torch.dtype):
        """`requests`: `sample_requests(run.sample, ...)`, whose prompts `dataset` has cached."""
        self.cfg, self.run_dir, self.max_steps = run.sample, run_dir, run.train.max_steps
        self.requests, self.engine = requests, engine
        if not requests:
            return
        sampling = spec.sampling()
        host = engine._host_group if engine.num_stages > 1 else dist.new_group(backend="gloo")
        self.host_group = host
        self.round = SampleRound(
            sampling, requests, dataset, StageLink.of_engine(engine, host),
            engine.grid.get_data_parallel_rank(), dist.get_world_size() // engine.num_stages,
            self.cfg.steps or sampling.default_steps,
            sampling.default_guidance if self.cfg.guidance is None else self.cfg.guidance,
            device, dtype, host, self.cfg.save_latents)

    def due(self, step: int) -> bool:
        if not self.requests:
            return False
        if step == 0:
            return self.cfg.at_start
        every = self.cfg.every_steps
        return step == self.max_steps or bool(every) and step % every == 0

    def missing(self, step: int) -> bool:
        """Whether a due round at `step` has left no complete set of files (a run killed while
        sampling after its checkpoint: the resumed run makes them). Rank 0 looks; every rank
        gets its answer."""
        if not self.due(step):
            return False
        folder = round_dir(self.run_dir, step)
        answer = [not all((folder / f"{r.index}.png").is_file()
                          or (folder / f"{r.index}.mp4").is_file() for r in self.requests)]
        dist.broadcast_object_list(answer, src=0, group=self.host_group)
        return answer[0]

    def run(self, step: int, writer=None) -> None:
        module = self.engine.module
        probe, module.probe = module.probe, None  # the memory planner measures a training step
        module.eval()
        try:
            self.round.run(module.forward, round_dir(self.run_dir, step),
                           self.run_dir / SAMPLES_DIR, f"at step {step}", writer, step)
        finally:
            module.train()
            module.probe = probe
