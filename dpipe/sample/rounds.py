"""One round of samples, made by every rank together: each data-parallel replica's pipeline
denoises its share of the requests, then rank 0 decodes and writes them all.

The prompts' embeddings come from the cache (`CachedDataset.request_keys`, filled with the
captions' or by `dpipe.data.prepare.prepare_prompts`), so no text encoder is in memory; the VAE
is loaded by rank 0 alone, kept on the CPU between rounds (so is the audio decoder of a family
that makes sound: its waveform goes into the clip's file). A sample that fails on some rank
(out of memory, say) is logged and left out; the others are written.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from dpipe.data.batches import CachedDataset
from dpipe.models.sampling import FamilySampling, SampleRequest
from dpipe.pipeline.memory import GiB
from dpipe.sample import outputs
from dpipe.sample.denoise import denoise
from dpipe.sample.link import StageLink

log = logging.getLogger("dpipe")


class SampleRound:
    """Collective: every rank builds one with the same requests and calls `run` together."""

    def __init__(self, sampling: FamilySampling, requests: list[SampleRequest],
                 dataset: CachedDataset, link: StageLink, replica: int, replicas: int,
                 steps: int, guidance: float, device: torch.device, dtype: torch.dtype,
                 host_group, save_latents: bool = False):
        self.sampling, self.requests, self.dataset, self.link = sampling, requests, dataset, link
        self.steps, self.guidance, self.device, self.dtype = steps, guidance, device, dtype
        self.host_group, self.save_latents = host_group, save_latents
        self.mine = list(range(len(requests)))[replica::replicas]
        self.vae = self.sound_decoder = None  # loaded by rank 0 at its first decode

    def run(self, forward: Callable[[tuple], torch.Tensor], folder: Path, index_dir: Path,
            what: str, writer=None, step: int = 0) -> None:
        """Denoises with `forward` (this rank's stage), then rank 0 writes the samples to
        `folder`, adds them to TensorBoard's `writer` at `step`, and rewrites the index page
        of `index_dir` (the run's samples/, whose step_<N> rounds it shows, or `folder`
        itself). `what` names the round in the log."""
        started = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        self.link.error = None
        states = [self._start(self.requests[i]) for i in self.mine]
        failed = denoise(self.sampling, states, self.link, forward, self.steps)
        peak = (torch.cuda.max_memory_allocated() - resident) / GiB if cuda else 0.0
        mine = ([(s.request.index, s.latents.cpu(), bad) for s, bad in zip(states, failed)]
                if self.link.first else [])
        error = self.link.error
        error = None if error is None else f"{type(error).__name__}: {error}"
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, error, peak), group=self.host_group)
        if dist.get_rank() == 0:
            self._write(gathered, folder, index_dir, what, writer, step,
                        time.perf_counter() - started)

    def _start(self, request: SampleRequest):
        text_key, uncond_key, control_key = self.dataset.request_keys[request.index]

        owner = f"sample.prompts[{request.index}]"

        def batched(key, role):
            return {k: v[None].to(self.device)
                    for k, v in self.dataset.entry(key, owner, role).items()}

        control = None
        if control_key is not None:
            keys = (control_key,) if isinstance(control_key, str) else control_key
            latents = [self.dataset.entry(k, path, "control latents", path)["latents"]
                       for k, path in zip(keys, request.controls)]
            # One reference: (1, C, h, w); several: (1, R, C, h, w) (NoisedBatch.control).
            stacked = latents[0] if len(latents) == 1 else torch.stack(latents)
            control = stacked[None].to(self.device)
        return self.sampling.start(request, self.steps, self.guidance,
                                   batched(text_key, "prompt embedding"),
                                   batched(uncond_key, "negative prompt embedding"), control,
                                   self.device)

    def _write(self, gathered: list, folder: Path, index_dir: Path, what: str, writer,
               step: int, seconds: float) -> None:
        errors = sorted({e for _, e, _ in gathered if e})
        peak = max(p for _, _, p in gathered)
        written, failed = 0, []
        fps = self.sampling.fps
        for mine, _, _ in gathered:
            for index, latents, bad in mine:
                request = self.requests[index]
                if bad:
                    failed.append(request)
                    continue
                try:
                    latents = self.sampling.output_latents(request, latents)
                    pixels = self._decode(latents)
                    # A one-frame sample is a PNG, which holds no sound.
                    sound = (self._decode_sound(latents)
                             if self.sampling.makes_sound() and request.frames > 1 else None)
                    outputs.write_sample(folder, request, pixels, fps,
                                         latents if self.save_latents else None, sound)
                    if writer is not None:
                        outputs.add_to_tensorboard(writer, request, pixels, fps, step, sound)
                    written += 1
                except Exception as error:  # noqa: BLE001 - a failed decode costs this sample only
                    failed.append(request)
                    errors.append(f"decoding: {type(error).__name__}: {error}")
        if writer is not None:
            writer.flush()
        outputs.write_prompts(folder, self.requests)
        outputs.write_index(index_dir, [folder] if folder == index_dir else None)
        memory = f", {peak:.2f} GiB of GPU memory on top of what was resident" if peak else ""
        log.info("samples %s: %d in %.1f s (%d denoising steps%s) -> %s", what, written,
                 seconds, self.steps, memory, folder)
        if failed:
            log.error("samples %s: %d failed (item %s): %s", what, len(failed),
                      ", ".join(str(r.index) for r in failed), "; ".join(errors))

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            self.vae = self.sampling.load_vae(torch.device("cpu"), self.dtype)
        with self._on_device(self.vae):
            return self.sampling.decode(self.vae, latents.to(self.device)).cpu()

    def _decode_sound(self, latents: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(waveform (channels, samples), sample rate) of a joint audio-video sample."""
        if self.sound_decoder is None:
            self.sound_decoder = self.sampling.load_sound_decoder(torch.device("cpu"), self.dtype)
        with self._on_device(self.sound_decoder):
            waveform, rate = self.sampling.decode_sound(self.sound_decoder,
                                                        latents.to(self.device))
        return waveform.cpu(), rate

    @contextlib.contextmanager
    def _on_device(self, module):
        """A decoder on the sampling device while it decodes, back on the CPU after."""
        module.to(self.device)
        try:
            yield
        finally:
            if self.device.type == "cuda":
                module.to("cpu")
                torch.cuda.empty_cache()
