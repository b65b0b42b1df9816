"""Filling the cache: decode and fit files in worker processes, encode on this rank's device,
write entries from a thread pool. Each entry is written as soon as it is made, so a crashed or
killed run redoes only what it had not written."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from PIL import Image
from tqdm import tqdm

from dpipe.data.audio import AudioSource, load_audio, sample_count
from dpipe.data.cache_store import TensorStore
from dpipe.images import crop_top_left, fit, load_image, open_mask
from dpipe.data.video import load_clip
from dpipe.errors import DataError
from dpipe.models.spec import ModelSpec

log = logging.getLogger(__name__)
ENCODE_BATCH = 8  # images per VAE call
TEXT_BATCH = 32  # captions per text-encoder call
MIN_JOBS_PER_WORKER = 32  # below this, decoding in-process beats starting workers


class LatentJob(NamedTuple):
    """Encode a file (image, video clip, or control image) fitted to a bucket."""

    key: str
    path: str
    media: str  # "image" or "video"
    width: int
    height: int
    frames: int = 1
    start: int = 0
    fps: float | None = None
    role: str = "image"  # "image" or "control": what a failure means
    source_size: tuple[int, int] | None = None  # the file's (width, height), for the metadata
    # Clips: images that replace the first / last of its frames (first_frame_dir, last_frame_dir)
    first_frame: str | None = None
    last_frame: str | None = None

    @property
    def group(self) -> tuple:
        # The media too: a clip cut to one frame is (3, 1, H, W), an image (3, H, W); the two
        # never share a VAE call.
        return ("latent", self.media, self.width, self.height, self.frames)


class MaskJob(NamedTuple):
    key: str
    path: str
    width: int
    height: int
    role: str = "mask"

    @property
    def group(self) -> tuple:
        return ("mask", self.width, self.height)


class AudioJob(NamedTuple):
    """Encode the sound of a clip's frames start .. start+frames-1 at `fps`."""

    key: str
    path: str  # the clip (what a failure names)
    source: AudioSource
    start: int
    frames: int
    fps: float
    rate: int  # the model's sample rate and channels
    channels: int
    role: str = "audio"

    @property
    def group(self) -> tuple:
        return ("audio", sample_count(self.frames, self.fps, self.rate), self.channels)


class TextJob(NamedTuple):
    key: str
    caption: str
    # For models whose text encoder reads the control image: the control file, fitted to
    # width x height (the sample's bucket) as its control latents are; a tuple of files, in
    # order, where the sample has several references.
    control: str | tuple[str, ...] | None = None
    width: int = 0
    height: int = 0
    # A sample's negative prompt, for families that encode those apart (negative_prompts_differ).
    negative: bool = False


@dataclass(frozen=True)
class Failure:
    key: str
    path: str
    role: str
    error: str


def decode(job: LatentJob | MaskJob | AudioJob) -> torch.Tensor:
    """Pixels of a job: (3, H, W) or (3, F, H, W) in [-1, 1]; masks (1, H, W) uint8; sound
    (channels, samples) in [-1, 1]."""
    if isinstance(job, AudioJob):
        return load_audio(job.source, job.start, job.frames, job.fps, job.rate, job.channels)
    if isinstance(job, MaskJob):
        image = fit(open_mask(job.path), job.width, job.height, Image.Resampling.BILINEAR)
        return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(
            1, job.height, job.width).clone()
    if job.media == "video":
        clip = load_clip(job.path, job.start, job.frames, job.fps, job.width, job.height)
        # The given frames, fitted to the bucket as the clip's own are; a clip cut to one frame
        # keeps its first.
        for index, image in ((-1, job.last_frame if clip.shape[1] > 1 else None),
                             (0, job.first_frame)):
            if image is not None:
                clip[:, index] = load_image(image, job.width, job.height)
        return clip
    return load_image(job.path, job.width, job.height)


class _Decoding(torch.utils.data.Dataset):
    def __init__(self, jobs):
        self.jobs = jobs

    def __len__(self) -> int:
        return len(self.jobs)

    def __getitem__(self, i):
        try:
            pixels = decode(self.jobs[i])
        except DataError as error:
            return i, None, str(error)
        if pixels.is_floating_point() and not isinstance(self.jobs[i], AudioJob):
            # Back to the 8-bit values they came from (exactly): a quarter of the bytes to send
            # from the worker; `_as_float` restores the very same floats.
            pixels = pixels.add(1.0).mul(127.5).round_().to(torch.uint8)
        return i, pixels, None


def _as_float(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.float() / 127.5 - 1.0


def _identity(x):
    return x


def _one_thread(_worker: int) -> None:
    torch.set_num_threads(1)  # the workers already use every core between them


def default_workers(local_world: int = 1) -> int:
    return max(1, min(8, (os.cpu_count() or 1) // max(1, local_world)))


def run_jobs(spec: ModelSpec, store: TensorStore, jobs: list, texts: list[TextJob],
             device: torch.device, dtype: torch.dtype, workers: int,
             show: bool) -> tuple[list[Failure], dict[str, int]]:
    """Makes every job's entry; returns the files that could not be decoded and counts."""
    counts = {"latents": 0, "masks": 0, "texts": 0, "audio": 0}
    failures: list[Failure] = []
    if not jobs and not texts:
        return failures, counts
    needs_encoders = texts or any(isinstance(j, (LatentJob, AudioJob)) for j in jobs)
    encoders = spec.load_encoders(device, dtype) if needs_encoders else None
    bar = tqdm(total=len(jobs) + len(texts), desc="caching", unit="entry", disable=not show,
               dynamic_ncols=True)
    jobs = sorted(jobs, key=lambda j: (j.group, j.key))  # runs of one shape batch together
    use = workers if len(jobs) >= MIN_JOBS_PER_WORKER * 2 else 0
    loader = torch.utils.data.DataLoader(
        _Decoding(jobs), batch_size=None, num_workers=use, collate_fn=_identity,
        worker_init_fn=_one_thread if use else None, prefetch_factor=4 if use else None)
    with store.writer() as writer:
        pending: list[tuple[Any, torch.Tensor]] = []

        def flush():
            if pending:
                encode = _encode_audio if isinstance(pending[0][0], AudioJob) else \
                    _encode_latents
                encode(spec, encoders, pending, writer, counts)
                pending.clear()

        for i, pixels, error in loader:
            job = jobs[i]
            bar.update(1)
            if error is not None:
                failures.append(Failure(job.key, job.path, job.role, error))
                continue
            if isinstance(job, MaskJob):
                writer.put(job.key, {"mask": pixels}, {"kind": "mask", "source": job.path})
                counts["masks"] += 1
                continue
            if pending and (pending[0][0].group != job.group or len(pending) >= ENCODE_BATCH):
                flush()
            pending.append((job, pixels if isinstance(job, AudioJob) else _as_float(pixels)))
        flush()
        for negative in (False, True):
            plain = [t for t in texts if t.control is None and t.negative == negative]
            for start in range(0, len(plain), TEXT_BATCH):
                chunk = plain[start:start + TEXT_BATCH]
                encode = spec.encode_negative_prompts if negative else spec.encode_prompts
                embeds = encode(encoders, [t.caption for t in chunk])
                _put_texts(writer, chunk, embeds)
                counts["texts"] += len(chunk)
                bar.update(len(chunk))
        failures += _encode_texts_with_controls(
            spec, encoders, [t for t in texts if t.control is not None], writer, counts, bar)
    bar.close()
    return failures, counts


def _put_texts(writer, chunk: list[TextJob], embeds: dict[str, torch.Tensor]) -> None:
    for j, t in enumerate(chunk):
        meta = {"kind": "text", "caption": t.caption[:500]}
        if t.control is not None:
            meta.update(control=t.control if isinstance(t.control, str) else "\n".join(t.control),
                        shape=f"{t.width}x{t.height}")
        writer.put(t.key, {name: e[j].float().cpu() for name, e in embeds.items()}, meta)


def _encode_texts_with_controls(spec, encoders, texts: list[TextJob], writer, counts,
                                bar) -> list[Failure]:
    """Captions encoded with their control images, a run of one control size at a time. The
    controls are decoded here (one small image per caption, next to a VL encoder's cost)."""
    failures: list[Failure] = []
    def shape(t: TextJob):  # a chunk stacks its controls: one size, one reference count
        return t.width, t.height, 1 if isinstance(t.control, str) else len(t.control)

    texts = sorted(texts, key=lambda t: (shape(t), t.key))
    chunks: list[list[TextJob]] = []
    for t in texts:
        if chunks and len(chunks[-1]) < ENCODE_BATCH and shape(chunks[-1][0]) == shape(t):
            chunks[-1].append(t)
        else:
            chunks.append([t])
    for chunk in chunks:
        ready, pixels = [], []
        for t in chunk:
            try:
                if isinstance(t.control, str):
                    pixels.append(load_image(t.control, t.width, t.height))
                else:
                    pixels.append(torch.stack([load_image(c, t.width, t.height)
                                               for c in t.control]))
                ready.append(t)
            except DataError as error:
                failures.append(Failure(t.key, str(t.control), "control", str(error)))
        if ready:
            embeds = spec.encode_prompts_with_controls(
                encoders, [t.caption for t in ready], torch.stack(pixels))
            _put_texts(writer, ready, embeds)
            counts["texts"] += len(ready)
        bar.update(len(chunk))
    return failures


def _encode_latents(spec, encoders, pending, writer, counts) -> None:
    pixels = torch.stack([p for _, p in pending])
    encode_videos = getattr(spec, "encode_videos", None)
    if encode_videos is not None:
        # Video models take (B, 3, F, H, W); images are one-frame clips.
        latents = encode_videos(encoders, pixels if pixels.ndim == 5 else pixels.unsqueeze(2))
    else:
        latents = spec.encode_images(encoders, pixels)
    latents = latents.float().cpu()
    for (job, _), latent in zip(pending, latents):
        meta = {"kind": "latents", "source": job.path, "role": job.role,
                "shape": f"{job.width}x{job.height}x{job.frames}", "start": str(job.start)}
        if job.source_size is not None:  # how the file was fitted (SDXL's size/crop ids)
            src_w, src_h = job.source_size
            top, left = crop_top_left(src_w, src_h, job.width, job.height)
            meta.update(original_size=f"{src_h},{src_w}", crop_top_left=f"{top},{left}")
        if job.fps is not None:
            meta["fps"] = f"{job.fps:g}"
        writer.put(job.key, {"latents": latent}, meta)
    counts["latents"] += len(pending)



def _encode_audio(spec, encoders, pending, writer, counts) -> None:
    """Sounds of one length (a run of one `AudioJob.group`) through the family's audio encoder."""
    latents = spec.encode_audio(encoders, torch.stack([w for _, w in pending])).float().cpu()
    for (job, _), latent in zip(pending, latents):
        writer.put(job.key, {"audio": latent}, {
            "kind": "audio latents", "source": job.source.path or "silence",
            "origin": job.source.origin, "clip": job.path, "start": str(job.start),
            "frames": str(job.frames), "fps": f"{job.fps:g}", "rate": str(job.rate),
            "channels": str(job.channels)})
    counts["audio"] += len(pending)
