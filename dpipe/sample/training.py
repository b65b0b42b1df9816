"""Samples while a run trains, made by the training processes through their own stages.

No rank ever holds more of the denoiser than its stage: each round runs forward-only through the
pipeline engine's layers as they stand. The prompts were encoded with the captions, into the
same cache (so no text encoder stays in memory); the VAE is loaded by rank 0 alone, which
decodes and writes every sample. Data-parallel replicas share the prompts between them.

A sample that fails (out of memory, say) is logged and left out; training goes on, and a round
always runs after the step's checkpoint, so it can never cost one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dpipe.data.batches import CachedDataset
from dpipe.models.sampling import SampleRequest
from dpipe.pipeline.memory import GiB
from dpipe.sample import outputs
from dpipe.sample.denoise import denoise
from dpipe.sample.link import StageLink

log = logging.getLogger("dpipe")
SAMPLES_DIR = "samples"


def round_dir(run_dir: Path, step: int) -> Path:
    return run_dir / SAMPLES_DIR / f"step_{step}"


class TrainingSamples:
    """Collective: every rank builds one and calls `maybe_run` at the same steps."""

    def __init__(self, spec, run, requests: list[SampleRequest], run_dir: Path,
                 dataset: CachedDataset, engine, device: torch.device, dtype: torch.dtype):
        """`requests`: `sample_requests(run.sample, ...)`, whose prompts `dataset` has cached."""
        self.cfg, self.run_dir, self.device, self.dtype = run.sample, run_dir, device, dtype
        self.max_steps = run.train.max_steps
        self.requests = requests
        if not self.requests:
            return
        self.sampling = spec.sampling()
        self.steps = self.cfg.steps or self.sampling.default_steps
        self.guidance = (self.sampling.default_guidance if self.cfg.guidance is None
                         else self.cfg.guidance)
        self.dataset, self.engine = dataset, engine
        host = engine._host_group if engine.num_stages > 1 else dist.new_group(backend="gloo")
        self.host_group = host
        self.link = StageLink.of_engine(engine, host)
        replicas = dist.get_world_size() // engine.num_stages
        replica = engine.grid.get_data_parallel_rank()
        self.mine = list(range(len(self.requests)))[replica::replicas]
        self.vae = None

    @property
    def enabled(self) -> bool:
        return bool(self.requests)

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

    def maybe_run(self, step: int, reporter=None) -> None:
        if self.due(step):
            self.run(step, getattr(reporter, "writer", None))

    # ---- one round -----------------------------------------------------------------------------
    def run(self, step: int, writer=None) -> None:
        started = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        module = self.engine.module
        probe, module.probe = module.probe, None  # the memory planner measures a training step
        module.eval()
        self.link.error = None
        states = [self._start(self.requests[i]) for i in self.mine]
        try:
            failed = denoise(self.sampling, states, self.link, module.forward, self.steps)
        finally:
            module.train()
            module.probe = probe
        peak = (torch.cuda.max_memory_allocated() - resident) / GiB if cuda else 0.0
        mine = [(state.request.index, state.latents.cpu(), bad) for state, bad
                in zip(states, failed)] if self.link.first else []
        error = None if self.link.error is None else f"{type(self.link.error).__name__}: {self.link.error}"
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, error, peak), group=self.host_group)
        if dist.get_rank() == 0:
            self._write(step, gathered, writer, time.perf_counter() - started)

    def _start(self, request: SampleRequest):
        text_key, uncond_key, control_key = self.dataset.request_keys[request.index]

        def batched(key):
            return {k: v[None].to(self.device) for k, v in self.dataset.store.get(key).items()}

        control = None
        if control_key is not None:
            control = self.dataset.store.get(control_key)["latents"][None].to(self.device)
        return self.sampling.start(request, self.steps, self.guidance, batched(text_key),
                                   batched(uncond_key), control, self.device)

    def _write(self, step: int, gathered: list, writer, seconds: float) -> None:
        folder = round_dir(self.run_dir, step)
        errors = sorted({e for _, e, _ in gathered if e})
        peak = max(p for _, _, p in gathered)
        written, failed = 0, []
        for mine, _, _ in gathered:
            for index, latents, bad in mine:
                request = self.requests[index]
                if bad:
                    failed.append(request)
                    continue
                try:
                    pixels = self._decode(latents)
                    outputs.write_sample(folder, request, pixels, self.sampling.fps,
                                         latents if self.cfg.save_latents else None)
                    if writer is not None:
                        outputs.add_to_tensorboard(writer, request, pixels, self.sampling.fps, step)
                    written += 1
                except Exception as error:  # noqa: BLE001 - a failed decode costs this sample only
                    failed.append(request)
                    errors.append(f"decoding: {type(error).__name__}: {error}")
        if writer is not None:
            writer.flush()
        outputs.write_index(self.run_dir / SAMPLES_DIR, self.requests)
        memory = f", {peak:.2f} GiB of GPU memory on top of training's" if peak else ""
        log.info("samples at step %d: %d in %.1f s (%d denoising steps%s) -> %s", step, written,
                 seconds, self.steps, memory, folder)
        if failed:
            log.error("samples at step %d: %d failed (%s): %s; training goes on", step,
                      len(failed), ", ".join(str(r.index) for r in failed), "; ".join(errors))

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            self.vae = self.sampling.load_vae(torch.device("cpu"), self.dtype)
        self.vae.to(self.device)
        try:
            return self.sampling.decode(self.vae, latents.to(self.device)).cpu()
        finally:
            if self.device.type == "cuda":
                self.vae.to("cpu")
                torch.cuda.empty_cache()
