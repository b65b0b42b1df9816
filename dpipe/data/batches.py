"""Turns planned samples into the model's micro-batch tuples, with per-sample noise.

Noise, timesteps, the caption variant and caption dropout of a sample all come from random
streams seeded by (seed, step, slot), so every stage and every resumed run derives the same ones.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from dpipe.config.schema import TimestepConfig, TimestepWeighting
from dpipe.data.cache_store import DamagedEntry, TensorStore
from dpipe.data.conditioning import draw_mode
from dpipe.data.loader import InMainProcess
from dpipe.data.manifest import Sample
from dpipe.data.plan import BatchPlan
from dpipe.diffusion.noise import sample_generator
from dpipe.diffusion.timesteps import sample_timesteps
from dpipe.diffusion.weighting import timestep_weights
from dpipe.errors import ConfigError, DataError
from dpipe.models.spec import ModelSpec, NoisedBatch

log = logging.getLogger(__name__)


def _role(key: str, sample: Sample) -> str:
    """What the entry `key` is to `sample`, for messages."""
    roles = {sample.latent: "latents", sample.mask: "mask", sample.audio: "audio latents",
             **{k: "control latents" for k in sample.control_keys}}
    return roles.get(key, "caption embedding")


def sample_conditions(samples: list[Sample]) -> dict[str, torch.Tensor | None]:
    """The NoisedBatch fields that come from the manifest alone (no cache read)."""
    def pairs(name):
        values = [getattr(s, name) for s in samples]
        return None if any(v is None for v in values) else torch.tensor(values, dtype=torch.long)

    fps = [s.fps for s in samples]
    return {"original_size": pairs("original_size"), "crop_top_left": pairs("crop_top_left"),
            "fps": None if all(f is None for f in fps) else torch.tensor(
                [float("nan") if f is None else f for f in fps], dtype=torch.float32)}


class CachedDataset:
    """Reads samples' tensors from the cache. `log` (a file or None) records each micro-batch.

    `remake(keys)` makes entries again from the dataset and returns why, for each it could not
    (`prepare.remake_entries`): an entry found damaged or missing while training is re-made in
    the main process, where the encoders can use the device; without it, that is an error."""

    def __init__(self, store: TensorStore, rank: int = 0, log=None,
                 remake: Callable[[set[str]], dict[str, str]] | None = None):
        self.store = store
        self.rank = rank
        self.log = log
        self.remake = remake
        # Video families: each frame mode's probability (`dpipe.data.conditioning`), or None.
        self.frame_probabilities: dict[str, float] | None = None
        # Per sample request: (prompt, negative prompt, control latents or None) cache keys.
        self.request_keys: list[tuple[str, str, str | None]] = []

    def get(self, key: str, sample: Sample) -> dict[str, torch.Tensor]:
        return self.entry(key, sample.source, _role(key, sample), sample.source)

    def entry(self, key: str, owner: str, role: str,
              source: str | None = None) -> dict[str, torch.Tensor]:
        """The entry `key`, re-made if it is damaged or missing; `owner` and `role` name it in
        messages ("/data/a.png", "latents"), `source` is the file it is made from, if any."""
        try:
            tensors = self.store.get(key)  # verified against its checksum
        except DamagedEntry as damage:
            return self._remake(key, owner, role, source, f"damaged ({damage.reason})")
        if tensors is None:
            return self._remake(key, owner, role, source, "missing")
        return tensors

    def _remake(self, key: str, owner: str, role: str, source: str | None,
                state: str) -> dict[str, torch.Tensor]:
        entry = f"the cache entry of {owner} ({role}, {self.store.path_for(key)})"
        if self.remake is None:
            self.store.remove(key)
            raise DataError(f"{entry} is {state}: removed it; run the command again to make it "
                            "anew")
        if torch.utils.data.get_worker_info() is not None:
            raise InMainProcess(entry)
        start = time.perf_counter()
        unmade = self.remake({key})
        if key in unmade:
            # Of no use to anyone: removed, a later start plans the data as it is now.
            self.store.remove(key)
            if source is not None and not Path(source).exists():
                why = (f"its file {source} is gone. Put it back and run the command again, or "
                       "run it without the file (the data plan then leaves it out)")
            else:
                why = (f"{unmade[key]} ({owner} or its caption changed since the run planned "
                       "its data). Run the command again: it plans the data as it is now")
            raise DataError(f"{entry} is {state} and cannot be re-made: {why}")
        tensors = self.store.get(key)
        log.warning("%s was %s: re-made it in %.1f s", entry, state, time.perf_counter() - start)
        return tensors

    def collate(self, samples: list[Sample], texts: list[str]):
        """(latents, text dict, loss weights or None, control latents or None) of the samples,
        with `texts[i]` the text key chosen for sample i."""
        latents = torch.stack([self.get(s.latent, s)["latents"] for s in samples])
        embeds = [self.get(k, s) for k, s in zip(texts, samples)]
        text = {name: torch.stack([e[name] for e in embeds]) for name in embeds[0]}
        weight = None
        if any(s.mask for s in samples):
            weight = torch.stack([self._weight(s, latents.shape[1:]) for s in samples])
        control = None
        if any(s.control for s in samples):
            counts = {len(s.control_keys) for s in samples}
            if len(counts) > 1:
                first = min(samples, key=lambda s: len(s.control_keys))
                raise DataError(
                    f"a micro-batch mixes files with {' and '.join(map(str, sorted(counts)))} "
                    f"control images ({first.source} has {len(first.control_keys)}); give "
                    "every file of a bucket as many (and a control_dir to every directory), "
                    "or set pipeline.micro_batch_size=1")
            control = torch.stack([self._references(s) for s in samples])
        return latents, text, weight, control

    def _references(self, sample: Sample) -> torch.Tensor:
        """A sample's control latents: (C, h, w) for one reference, (R, C, h, w) for several
        (`dpipe.models.spec.reference_latents`)."""
        if isinstance(sample.control, str):
            return self.get(sample.control, sample)["latents"]
        return torch.stack([self.get(k, sample)["latents"] for k in sample.control])

    def audio(self, samples: list[Sample]) -> torch.Tensor | None:
        """The clips' audio latents, stacked; None where no sample has sound (images, or a
        model that trains on none). A micro-batch holds one bucket, whose clips have sound of
        one length (prepare checks it): a mix is a bug, not bad input."""
        if not any(s.audio for s in samples):
            return None
        if not all(s.audio for s in samples):
            silent = [s.source for s in samples if not s.audio]
            raise DataError(f"a batch mixes clips with and without sound ({silent[0]}): its "
                            "samples must all come from clips of more than one frame")
        audio = [self.get(s.audio, s)["audio"] for s in samples]
        if len({a.shape for a in audio}) > 1:
            raise DataError("a batch's clips have audio latents of different lengths ("
                            + ", ".join(f"{s.source}: {tuple(a.shape)}"
                                        for s, a in zip(samples, audio)) + ")")
        return torch.stack(audio)

    def _weight(self, sample: Sample, latent_shape: torch.Size) -> torch.Tensor:
        h, w = latent_shape[-2:]
        lead = (1,) * (len(latent_shape) - 2)  # (1,) for (C, h, w); (1, 1) for (C, F, h, w)
        if not sample.mask:
            return torch.ones(*lead, h, w)
        mask = self.get(sample.mask, sample)["mask"].float().div(255.0)  # (1, H, W) pixels
        # Area averaging: a latent pixel's weight is the mean of the pixels it covers.
        pooled = F.interpolate(mask[None], size=(h, w), mode="area")[0]
        return pooled.view(*lead, h, w)

    def write_log(self, step: int, micro: int, dp_rank: int, batch, latents: torch.Tensor,
                  records: list | None = None):
        """Writes the micro-batch's log record, or appends it to `records` (a loader's worker
        process leaves the writing to the main process, which keeps the file in step order)."""
        if self.log is None:
            return
        record = {"rank": self.rank, "step": step, "micro": micro, "dp_rank": dp_rank,
                  "bucket": batch.bucket.name, "shape": list(latents.shape),
                  "samples": [f"{s.source}@{s.start}" for s in batch.samples]}
        if records is not None:
            records.append(record)
        else:
            self.write_record(record)

    def write_record(self, record: dict) -> None:
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()


def noised_batch(
    spec: ModelSpec, latents: torch.Tensor, text: dict[str, torch.Tensor],
    timesteps_cfg: TimestepConfig, seed: int, step: int, slots: range,
    loss_weight: torch.Tensor | None = None, control: torch.Tensor | None = None,
    timesteps: torch.Tensor | None = None, conditions: dict | None = None,
    audio: torch.Tensor | None = None, frame_mode: torch.Tensor | None = None,
) -> NoisedBatch:
    """Noise and timesteps of each sample from (seed, step, slot); `timesteps` fixes them (evals:
    then no timestep weighting, so eval losses compare across `train.timesteps.weighting`);
    `conditions`: `sample_conditions` of the samples; `audio`: the clips' audio latents, noised
    at the same t with noise of their own stream; `frame_mode`: each sample's frame mode."""
    noise, t = [], []
    # shift=auto: the family sampler's shift at this micro-batch's (its bucket's) latent size.
    shift = spec.training_shift(latents.shape[1:]) if timesteps_cfg.auto_shift else None
    for slot, x0 in zip(slots, latents):
        noise.append(torch.randn(x0.shape, generator=sample_generator(seed, step, slot, "noise")))
        if timesteps is None:
            t.append(sample_timesteps(timesteps_cfg, 1, sample_generator(seed, step, slot, "t"),
                                      shift))
    noise_t = torch.stack(noise).to(latents.dtype)
    t_t = torch.cat(t) if timesteps is None else timesteps.to(torch.float32)
    noisy, target = spec.noise(latents, noise_t, t_t)
    if timesteps is None and timesteps_cfg.weighting != TimestepWeighting.none:
        weights = timestep_weights(timesteps_cfg.weighting, spec.train_timesteps(t_t))
        loss_weight = weigh_samples(loss_weight, weights, latents)
    sound = {} if audio is None else noised_audio(spec, audio, t_t, seed, step, slots)
    return NoisedBatch(latents=latents, noise=noise_t, timesteps=t_t, noisy=noisy, target=target,
                     text=text, loss_weight=loss_weight, control=control, **(conditions or {}),
                     frame_mode=frame_mode, **sound)


def noised_audio(spec: ModelSpec, audio: torch.Tensor, t: torch.Tensor, seed: int, step: int,
                 slots: range) -> dict[str, torch.Tensor]:
    """The NoisedBatch audio fields: the audio latents noised at the video's t (audio-video
    models denoise both streams on one schedule), from a noise stream of their own."""
    noise = torch.stack([
        torch.randn(a.shape, generator=sample_generator(seed, step, slot, "audio_noise"))
        for slot, a in zip(slots, audio)]).to(audio.dtype)
    noisy, target = spec.noise(audio, noise, t)
    return {"audio": audio, "audio_noise": noise, "audio_noisy": noisy, "audio_target": target}


def weigh_samples(loss_weight: torch.Tensor | None, weights: torch.Tensor | None,
                  latents: torch.Tensor) -> torch.Tensor | None:
    """The per-pixel loss weights (masks, or 1) times each sample's weight: the path every
    family's loss already averages with, so per-sample weights need nothing of the families."""
    if weights is None:
        return loss_weight
    # (B, 1, h, w) for images, (B, 1, 1, h, w) for video: as `CachedDataset` builds mask weights.
    shape = (len(latents), *([1] * (latents.dim() - 3)), *latents.shape[-2:])
    base = torch.ones(shape) if loss_weight is None else loss_weight.float()
    return base * weights.view(-1, *([1] * (base.dim() - 1)))


def choose_texts(samples: list[Sample], empty_text: str | None, seed: int, step: int,
                 slots: range) -> list[str]:
    """Each sample's caption variant, or the empty caption with its dropout probability."""
    chosen = []
    for sample, slot in zip(samples, slots):
        gen = sample_generator(seed, step, slot, "caption")
        draw = torch.rand(2, generator=gen)
        empty = sample.empty or empty_text  # a caption encoded with its control image has its own
        if sample.dropout and empty and float(draw[0]) < sample.dropout:
            chosen.append(empty)
        else:
            chosen.append(sample.texts[int(draw[1] * len(sample.texts)) % len(sample.texts)])
    return chosen


def step_micro_batches(
    spec: ModelSpec, dataset: CachedDataset, plan: BatchPlan, timesteps_cfg: TimestepConfig,
    seed: int, step: int, dp_rank: int, records: list | None = None,
) -> Iterator[tuple[tuple, tuple]]:
    """The (inputs, labels) of each micro-batch of `step` on data-parallel rank `dp_rank`: a pure
    function of its arguments (see `dpipe.data.loader` for computing them ahead, in workers)."""
    for micro in range(plan.micro_batches):
        batch = plan.micro_batch(step, micro, dp_rank)
        texts = choose_texts(batch.samples, batch.empty_text, seed, step, batch.slots)
        latents, text, mask_weight, control = dataset.collate(batch.samples, texts)
        dataset.write_log(step, micro, dp_rank, batch, latents, records)
        weight = weigh_samples(mask_weight, directory_weights(batch.samples), latents)
        modes = dataset.frame_probabilities
        frame_mode = None if modes is None else torch.tensor(
            [draw_mode(modes, seed, step, slot) for slot in batch.slots], dtype=torch.long)
        noised = noised_batch(spec, latents, text, timesteps_cfg, seed, step, batch.slots,
                              weight, control, conditions=sample_conditions(batch.samples),
                              audio=dataset.audio(batch.samples), frame_mode=frame_mode)
        inputs, labels = spec.make_inputs(noised)
        if noised.loss_weight is not None and len(labels) < 2:  # never ignore weights silently
            used = [name for name, on in (
                ("masks (mask_dir)", mask_weight is not None),
                ("a directory's loss_weight", weight is not mask_weight),
                ("train.timesteps.weighting", noised.loss_weight is not weight)) if on]
            raise ConfigError(f"model.family={spec.family} does not apply loss weights yet: "
                              f"remove {' and '.join(used)} from the config")
        yield inputs, labels


def directory_weights(samples: list[Sample]) -> torch.Tensor | None:
    """(B,) each sample's directory `loss_weight`, or None where every one is 1."""
    if all(s.loss_weight is None for s in samples):
        return None
    return torch.tensor([1.0 if s.loss_weight is None else s.loss_weight for s in samples])


def prior_rows(samples: list[Sample]) -> list[int]:
    """The rows of a micro-batch whose directory trains with `prior_preservation`."""
    return [i for i, s in enumerate(samples) if s.prior]
