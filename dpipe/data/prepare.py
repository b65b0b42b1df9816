"""Before training: find the dataset's files, make sure the cache holds every tensor they need,
and describe the result (manifests, the batch plan, the dataset report).

Collective over all ranks when distributed. Rank 0 scans the directories (the stat index makes a
second start read no file) and works out every cache entry the run needs; the missing ones are
split between all ranks, each decoding with worker processes and encoding on its own device; then
every rank builds the same manifests from the same facts.

Each cache key covers the source file's content, the preprocessing and the encoder's identity,
so an entry made from anything else is simply never found.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from dpipe.config.schema import DatasetConfig, DatasetKind
from dpipe.data import discover as disc
from dpipe.data.batches import CachedDataset
from dpipe.data.buckets import AUTO_MAX_FRAMES, frames_from_clips
from dpipe.data.cache_store import KeyMaker, TensorStore
from dpipe.data.audio import AUDIO_DECODE_VERSION, sample_count
from dpipe.data.encode import (
    AudioJob, LatentJob, MaskJob, TextJob, default_workers, run_jobs)
from dpipe.data.manifest import Bucket, Manifest, Sample
from dpipe.data.plan import BatchPlan, load_history
from dpipe.data import conditioning
from dpipe.data.report import DataReport
from dpipe.data.sources import file_fingerprint, list_files
from dpipe.images import crop_top_left
from dpipe.data.synthetic import generate_shapes
from dpipe.data.video import timeline_length
from dpipe.errors import DataError, UserError
from dpipe.models.spec import ModelSpec

log = logging.getLogger(__name__)
DATA_DIR = "data"  # in the run dir: history, manifests, report, batch logs


@dataclass(frozen=True)
class Layout:
    """How samples are batched: fixed by the pipeline config and the number of ranks."""

    micro_batch_size: int = 1
    micro_batches: int = 1
    data_parallel: int = 1
    seed: int = 0
    steps: int = 0  # the run's steps: the report counts the frame modes they train

    @classmethod
    def of(cls, run, data_parallel: int) -> "Layout":
        return cls(run.pipeline.micro_batch_size, run.pipeline.micro_batches, data_parallel,
                   run.train.seed, run.train.max_steps)


@dataclass
class _Set:
    """One dataset (train, or an eval set) between discovery and its manifest."""

    name: str
    discovery: disc.Discovery
    placements: list[disc.Placement]
    # (latent, text keys, mask, control, own empty caption, audio) of each placement
    sample_keys: list[tuple[str, tuple[str, ...], str | None, str | None, str | None,
                            str | None]]
    dropped: list[tuple[str, str]]
    trimmed: list[tuple[str, str]]
    notes: list[str] = field(default_factory=list)  # choices made for the user (frame buckets)


@dataclass
class _Work:
    sets: list[_Set]
    jobs: list = field(default_factory=list)
    texts: list[TextJob] = field(default_factory=list)
    empty_text: str | None = None
    total_keys: int = 0
    keys: set[str] = field(default_factory=set)  # every entry the datasets use
    history: tuple = (None, {})
    reads: int = 0
    # Per sample request (dpipe.sample): the cache keys of its prompt's and negative prompt's
    # embeddings and of its control image's latents (None without one).
    request_keys: list[tuple[str, str, str | None]] = field(default_factory=list)


def prepare(spec: ModelSpec, cfg: DatasetConfig, device: torch.device, dtype: torch.dtype,
            layout: Layout | None = None, run_dir: Path | None = None,
            make_plan: bool = True, sample_requests: list | None = None) -> CachedDataset:
    """The cached dataset, with `.plan` (training batches; None without `make_plan`), `.evals`
    (name -> manifest), `.reports`, `.stats` and `.request_keys` (the cache keys of each of
    `sample_requests`: its prompts are encoded once, with the captions). The same on every rank."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    layout = layout or Layout()
    frame_probabilities = conditioning.frame_probabilities(spec, cfg)  # refuses bad modes first
    store = TensorStore(Path(cfg.cache_dir).expanduser())
    data_dir = Path(run_dir) / DATA_DIR if run_dir is not None else None

    work = _broadcast(lambda: _plan_work(spec, cfg, dtype, store, data_dir,
                                         sample_requests=sample_requests or [])
                      if rank == 0 else None)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    workers = cfg.cache_workers if cfg.cache_workers is not None else default_workers(local_world)
    failures, counts = run_jobs(spec, store, work.jobs[rank::world], work.texts[rank::world],
                                device, dtype, workers, show=rank == 0)
    failures = _gather(failures)
    gathered = _gather([counts])
    counts = {k: sum(c[k] for c in gathered) for k in counts}
    fatal = [f for f in failures if f.role not in ("image", "audio")]
    if fatal:
        raise DataError(f"{len(fatal)} mask/control file(s) cannot be read:"
                        + list_files([f"{f.path}: {f.error}" for f in fatal]))
    if failures and cfg.strict:
        raise DataError(f"{len(failures)} file(s) cannot be decoded (dataset.strict=true):"
                        + list_files([f"{f.path}: {f.error}" for f in failures])
                        + "\nReplace or delete them, or set dataset.strict=false to skip them.")

    failed = {f.key: f.error for f in failures}
    made = sum(counts.values())
    cache_note = (f"cache: {work.total_keys - len(work.jobs) - len(work.texts)} of "
                  f"{work.total_keys} entries were present, {made} made now ({store.root})")
    manifests, reports = {}, {}
    for s in work.sets:
        manifest, report = _manifest(s, cfg, layout, work.empty_text, failed, make_plan,
                                     _audio_format(spec))
        report.cache = cache_note if s.name == "train" else "cached with the training set"
        manifests[s.name], reports[s.name] = manifest, report

    dataset = CachedDataset(store, rank, remake=lambda keys: remake_entries(
        spec, cfg, device, dtype, keys, sample_requests))
    dataset.request_keys = work.request_keys
    dataset.evals = {k[len("eval "):]: m for k, m in manifests.items() if k != "train"}
    dataset.reports = reports
    dataset.stats = {"files_read": work.reads, **counts, "failed": len(failures),
                     "entries": work.total_keys}
    dataset.frame_probabilities = frame_probabilities
    history, saved = work.history
    dataset.plan = BatchPlan(manifests["train"], layout.micro_batch_size, layout.micro_batches,
                             layout.data_parallel, layout.seed, history, saved) if make_plan else None
    if frame_probabilities is not None and dataset.plan is not None:
        reports["train"].frame_modes = (frame_probabilities, conditioning.planned_counts(
            dataset.plan, frame_probabilities, layout.seed, layout.steps), layout.steps)
    if rank == 0:
        for report in reports.values():
            for line in report.lines():
                log.info("%s", line)
        unreadable = [f"{path}: {why}" for r in reports.values() for path, why in r.dropped
                      if why.startswith("unreadable")]
        if unreadable:
            log.warning("skipped %d unreadable file(s) (dataset.strict=true refuses them):%s",
                        len(unreadable), list_files(unreadable))
        if data_dir is not None:
            data_dir.mkdir(parents=True, exist_ok=True)
            for name, report in reports.items():
                report.write(data_dir / f"report-{name.replace(' ', '-')}.txt")
    if cfg.log_batches and data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        dataset.log = open(data_dir / f"batches-rank{rank:03d}.jsonl", "a")
    _barrier()
    return dataset


def resume_plan(dataset: CachedDataset, step: int, run_dir: Path) -> None:
    """Sets the batch plan for a run (re)starting at `step` (see `BatchPlan.resume`); rank 0
    says what changed in the data and saves the run's data history. Every rank must call it."""
    rank = dist.get_rank() if dist.is_initialized() else 0

    def cached(keys: set[str]) -> bool:  # collective: every rank asks at the same point
        return _broadcast(lambda: keys <= dataset.store.keys() if rank == 0 else None)

    note = dataset.plan.resume(step, cached)
    if rank == 0:
        if note:
            log.warning("%s", note)
        dataset.plan.save_history(Path(run_dir) / DATA_DIR)
    _barrier()


def needed_entries(spec: ModelSpec, cfg: DatasetConfig, dtype: torch.dtype) -> tuple[set[str], int]:
    """(every cache key the datasets use, how many of them are missing), encoding nothing."""
    work = _plan_work(spec, cfg, dtype, TensorStore(Path(cfg.cache_dir).expanduser()), None,
                      keep_keys=True)
    return work.keys, len(work.jobs) + len(work.texts)


def dataset_sets(cfg: DatasetConfig) -> list[tuple[str, list[disc.Directory], bool]]:
    """(name, directories, eval mode) of the training set and each eval set."""
    sets = [("train", disc.directories(cfg), False)]
    sets += [(f"eval {e.name}", disc.directories(cfg, e.directories), True)
             for e in cfg.eval.sets]
    return sets


def remake_entries(spec: ModelSpec, cfg: DatasetConfig, device: torch.device,
                   dtype: torch.dtype, keys: set[str],
                   sample_requests: list | None = None) -> dict[str, str]:
    """Makes the entries `keys` again (replacing what is there) from the dataset (and sample
    requests) as it is now, in this process alone (not collective: one rank's loader found them
    damaged or missing). Returns why, for each key that could not be made (its file is gone,
    changed or unreadable)."""
    store = TensorStore(Path(cfg.cache_dir).expanduser())
    work = _plan_work(spec, cfg, dtype, store, None, remake=keys,
                      sample_requests=sample_requests)
    jobs = [j for j in work.jobs if j.key in keys]
    texts = [t for t in work.texts if t.key in keys]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        failures, _counts = run_jobs(spec, store, jobs, texts, device, dtype, 0, show=False)
    planned = {j.key for j in jobs} | {t.key for t in texts}
    why = {f.key: f"cannot read {f.path}: {f.error}" for f in failures}
    return {k: why.get(k, "not in the dataset as it is now") for k in keys
            if k not in planned or k in why}


def _plan_work(spec: ModelSpec, cfg: DatasetConfig, dtype: torch.dtype, store: TensorStore,
               data_dir: Path | None, keep_keys: bool = False,
               sample_requests: list | None = None, remake: set[str] = frozenset()) -> _Work:
    if cfg.kind == DatasetKind.synthetic:
        generate_shapes(Path(cfg.path).expanduser(), cfg.num_images, cfg.resolution)
    multiple = spec.pixel_multiple
    latent_key, mask_key, text_key, seen_key = _key_makers(spec, dtype)
    sound = _audio_format(spec)
    audio_key = _audio_key(spec, dtype) if sound is not None else None
    sees_control = getattr(spec, "text_sees_control", False)
    jobs: dict[str, object] = {}
    texts: dict[str, TextJob] = {}
    caption_keys: dict[str, str] = {}
    work = _Work(sets=[])
    cache_dir = Path(cfg.cache_dir).expanduser()
    dropout = False
    for name, dirs, eval_mode in dataset_sets(cfg):
        found = disc.discover(dirs, cache_dir, cfg.strict, eval_mode, audio=sound is not None)
        work.reads += found.reads
        videos = [i.path for i in found.items if i.kind == "video"]
        if videos and not hasattr(spec, "encode_videos"):
            raise DataError(f"model family {spec.family} trains on images, but the dataset "
                            f"({name}) has {len(videos)} video(s):" + list_files(videos)
                            + "\nRemove them or choose a video model.")
        _check_references(spec, name, found)
        if sees_control:
            _check_controls(spec, name, found)
        notes = _choose_frame_buckets(spec, found)
        places, dropped, trimmed = disc.placements(found, multiple)
        keys = []
        for p in places:
            item = found.items[p.item]
            s = found.directories[item.directory].settings
            w, h, frames = p.shape
            fps = s.video_fps if item.kind == "video" else None
            latent = latent_key.fields(_source(item), item.kind, fps, w, h, frames, p.start)
            jobs.setdefault(latent, LatentJob(
                latent, item.path, item.kind, p.shape.width, p.shape.height, p.shape.frames,
                p.start, fps, source_size=(item.info["w"], item.info["h"]),
                first_frame=item.first_frame and item.first_frame[0],
                last_frame=item.last_frame and item.last_frame[0]))
            drops = not eval_mode and s.caption_dropout > 0
            text_keys, empty = [], None
            if sees_control:
                paths = tuple(path for path, _ in item.controls)
                shas = _joined(sha for _, sha in item.controls)
                for caption in item.captions + ([""] if drops else []):
                    k = seen_key.fields(shas, w, h, caption)
                    texts.setdefault(k, TextJob(k, caption, _one_or_all(paths), w, h))
                    text_keys.append(k)
                if drops:
                    empty = text_keys.pop()
            else:
                for caption in item.captions:
                    k = caption_keys.get(caption)
                    if k is None:
                        k = caption_keys[caption] = text_key.fields(caption)
                        texts[k] = TextJob(k, caption)
                    text_keys.append(k)
                dropout |= drops
            mask = control = None
            if item.mask:
                mask = mask_key.fields(item.mask[1], w, h)
                jobs.setdefault(mask, MaskJob(mask, item.mask[0], p.shape.width, p.shape.height))
            if item.controls:
                control_keys = []
                for path, sha in item.controls:
                    k = latent_key.fields(sha, "image", None, w, h, 1, 0)
                    jobs.setdefault(k, LatentJob(k, path, "image", w, h, role="control",
                                                 source_size=(item.info["w"], item.info["h"])))
                    control_keys.append(k)
                control = _one_or_all(tuple(control_keys))
            audio = None
            # Clips only: images (and clips cut to one frame) train the video path alone.
            if item.audio is not None and frames > 1:
                src, rate = item.audio, fps or item.info["fps"]
                start = p.start if src.origin != "silence" else 0  # silence is all alike
                audio = audio_key.fields(src.sha256 or "-", src.origin, rate, start, frames,
                                         sound.sample_rate, sound.channels)
                jobs.setdefault(audio, AudioJob(audio, src.path or item.path, src, start,
                                                frames, rate, sound.sample_rate, sound.channels))
            keys.append((latent, tuple(text_keys), mask, control, empty, audio))
        work.sets.append(_Set(name, found, places, keys, dropped, trimmed, notes))
    if dropout:
        work.empty_text = caption_keys.get("") or text_key.fields("")
        texts.setdefault(work.empty_text, TextJob(work.empty_text, ""))
    work.request_keys = _request_jobs(sample_requests or [], spec, dtype, latent_key, text_key,
                                      seen_key, jobs, texts, caption_keys)
    present = store.keys() - remake
    work.total_keys = len(jobs) + len(texts)
    if keep_keys:  # not in training: rank 0 would send them all to every rank for nothing
        work.keys = set(jobs) | set(texts)
    work.jobs = [j for k, j in jobs.items() if k not in present]
    work.texts = [t for k, t in texts.items() if k not in present]
    if data_dir is not None:
        work.history = load_history(data_dir)
    return work


def _choose_frame_buckets(spec: ModelSpec, found: disc.Discovery) -> list[str]:
    """Gives the directories that leave `frame_buckets` null theirs, chosen from their clips
    (`frames_from_clips`); returns the report's lines saying what was chosen."""
    notes = []
    for number, d in enumerate(found.directories):
        s = d.settings
        if s.frame_buckets is not None:
            continue
        lengths = [timeline_length(i.info, s.video_fps) for i in found.items
                   if i.directory == number and i.kind == "video"]
        chosen = frames_from_clips(lengths, spec.sampling().clip_frames if lengths else None)
        found.directories[number] = disc.Directory(d.path, replace(s, frame_buckets=chosen))
        if lengths:
            rate = f" at {s.video_fps:g} fps" if s.video_fps else ""
            notes.append(
                f"frame buckets {chosen} chosen from the {len(lengths)} clip(s) of {d.path}: the "
                f"longest clip that the shortest ({min(lengths)} frames{rate}) holds and "
                f"{spec.family} takes (at most {AUTO_MAX_FRAMES}); set dataset.frame_buckets "
                "to choose others")
    return notes


def _source(item: disc.Item) -> str:
    """What a sample's latents are made of: the file's sha256, and those of the images given
    as its first / last frame (so that a changed frame image makes new latents)."""
    given = [f"{what}:{frame[1]}" for what, frame in (("first", item.first_frame),
                                                       ("last", item.last_frame)) if frame]
    return "+".join([item.sha256, *given])


def _key_makers(spec: ModelSpec, dtype: torch.dtype) -> tuple[KeyMaker, ...]:
    """(latents, masks, texts, texts with their control image): what each kind of entry's key
    covers besides its fields."""
    image_fp, text_fp = spec.encoder_fingerprint("image"), spec.encoder_fingerprint("text")
    # Key parts, in order: latents (source sha256, media, fps, width, height, frames, first
    # frame), masks (source sha256, width, height), texts (the caption).
    latent_key = KeyMaker(kind="latents", encoder=image_fp, dtype=str(dtype), crop="centre",
                          fields=["source", "media", "fps", "width", "height", "frames", "start"])
    mask_key = KeyMaker(kind="mask", crop="centre", fields=["source", "width", "height"])
    text_key = KeyMaker(kind="text", encoder=text_fp, dtype=str(dtype), fields=["caption"])
    # Models whose text encoder reads the control image (Qwen-Image-Edit): a text entry is made
    # of the caption and the control image as fitted to the sample's bucket, so its key covers
    # the control file's content and that preprocessing too.
    seen_key = KeyMaker(kind="text+control", encoder=text_fp, dtype=str(dtype), crop="centre",
                        fields=["control source", "width", "height", "caption"])
    return latent_key, mask_key, text_key, seen_key


def _audio_format(spec: ModelSpec):
    """The sound the model trains on (`ModelSpec.audio_format`), or None."""
    audio_format = getattr(spec, "audio_format", None)
    return audio_format() if audio_format is not None else None


def _audio_key(spec: ModelSpec, dtype: torch.dtype) -> KeyMaker:
    """Audio latents: the sound's source (a clip's file, its sidecar, or silence) and its cut
    and resampling, the decoding code's version, and the audio encoder (its weights)."""
    return KeyMaker(kind="audio latents", encoder=spec.encoder_fingerprint("audio"),
                    dtype=str(dtype), decode=AUDIO_DECODE_VERSION, resampler="libswresample",
                    fields=["source", "origin", "fps", "start", "frames", "sample rate",
                            "channels"])


def _negative_key(spec: ModelSpec, dtype: torch.dtype) -> KeyMaker:
    """Negative prompts of the families that encode them apart (`negative_prompts_differ`)."""
    return KeyMaker(kind="negative text", encoder=spec.encoder_fingerprint("text"),
                    dtype=str(dtype), fields=["caption"])


def _request_jobs(requests: list, spec: ModelSpec, dtype: torch.dtype, latent_key: KeyMaker,
                  text_key: KeyMaker, seen_key: KeyMaker, jobs: dict, texts: dict,
                  caption_keys: dict) -> list[tuple[str, str, str | None]]:
    """Adds the entries that sample requests need (their prompts' and negative prompts'
    embeddings, their control images' latents) to `jobs` and `texts`; returns their keys."""
    sees_control = getattr(spec, "text_sees_control", False)
    negative_key = (_negative_key(spec, dtype) if requests and spec.negative_prompts_differ
                    else None)
    sampling = spec.sampling() if requests else None
    out = []
    for request in requests:
        control = sha = None
        w, h = sampling.control_size(request)
        if request.control is not None:
            shas = [file_fingerprint(Path(path)) for path in request.controls]
            control_keys = [latent_key.fields(one, "image", None, w, h, 1, 0) for one in shas]
            for k, path in zip(control_keys, request.controls):
                jobs.setdefault(k, LatentJob(k, path, "image", w, h, role="control"))
            control, sha = _one_or_all(tuple(control_keys)), _joined(shas)
        keys = []
        for caption in (request.prompt, request.negative_prompt):
            if caption is request.negative_prompt and negative_key is not None:
                k = negative_key.fields(caption)
                texts.setdefault(k, TextJob(k, caption, negative=True))
            elif sees_control and sha is not None:
                k = seen_key.fields(sha, w, h, caption)
                texts.setdefault(k, TextJob(k, caption, request.control, w, h))
            else:
                k = caption_keys.get(caption)
                if k is None:
                    k = caption_keys[caption] = text_key.fields(caption)
                    texts[k] = TextJob(k, caption)
            keys.append(k)
        out.append((keys[0], keys[1], control))
    return out


def prepare_prompts(spec: ModelSpec, cache_dir: str, device: torch.device, dtype: torch.dtype,
                    requests: list) -> CachedDataset:
    """The cache entries of sample requests alone (dpipe-sample: no dataset), made where
    missing; the returned dataset has their `request_keys`. Collective when distributed."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    store = TensorStore(Path(cache_dir).expanduser())
    latent_key, _mask, text_key, seen_key = _key_makers(spec, dtype)
    jobs: dict = {}
    texts: dict = {}
    keys = _request_jobs(requests, spec, dtype, latent_key, text_key, seen_key, jobs, texts, {})
    present = store.keys()
    jobs = [j for k, j in jobs.items() if k not in present]
    texts = [t for k, t in texts.items() if k not in present]
    failures, _counts = run_jobs(spec, store, jobs[rank::world], texts[rank::world], device,
                                 dtype, 0, show=False)
    failures = _gather(failures)
    if failures:
        raise DataError("cannot read the control image(s):"
                        + list_files([f"{f.path}: {f.error}" for f in failures]))
    dataset = CachedDataset(store, rank)
    dataset.request_keys = keys
    _barrier()
    return dataset


def _joined(shas) -> str:
    """The text+control key's "control source": the control file's sha256, or those of several
    references joined in their order (their order changes the encoding, so the key)."""
    return "+".join(shas)


def _one_or_all(values: tuple):
    """One reference as itself, several as the tuple (`Sample.control`, `TextJob.control`)."""
    return values[0] if len(values) == 1 else values


def _check_references(spec: ModelSpec, name: str, found: disc.Discovery) -> None:
    """No item may have more control images than the family takes (`ModelSpec.references`)."""
    most = getattr(spec, "references", 1)
    over = [f"{i.path}: {len(i.controls)} control images ({', '.join(p for p, _ in i.controls)})"
            for i in found.items if len(i.controls) > most]
    if over:
        raise DataError(
            f"model.family={spec.family} takes at most {most} control image(s) per file, but "
            f"{len(over)} file(s) of the dataset ({name}) have more:" + list_files(over)
            + f"\nKeep at most {most} per file (numbered <stem>_1, <stem>_2, ... files in "
            "control_dir, or the `control` lists of the captions file), or choose a family that "
            "takes more references.")


def _check_controls(spec: ModelSpec, name: str, found: disc.Discovery) -> None:
    missing = [i.path for i in found.items if not i.controls]
    if missing:
        raise DataError(
            f"model.family={spec.family} encodes each caption together with its control image, "
            f"but {len(missing)} file(s) of the dataset ({name}) have none:" + list_files(missing)
            + "\nSet dataset.control_dir (or control_dir of their directory) to a folder of "
            "same-stem control images.")


def _manifest(s: _Set, cfg: DatasetConfig, layout: Layout, empty_text: str | None,
              failed: dict[str, str], training: bool,
              sound=None) -> tuple[Manifest, DataReport]:
    eval_mode = s.name != "train"
    dropped, trimmed = list(s.discovery.dropped) + s.dropped, s.trimmed
    buckets: dict[str, Bucket] = {}
    reported: set[str] = set()
    upscaled: dict[str, dict[str, tuple[int, int]]] = {}  # directory -> {file: (w, h)}
    for p, (latent, texts, mask, control, empty, audio) in zip(s.placements, s.sample_keys):
        item = s.discovery.items[p.item]
        settings = s.discovery.directories[item.directory].settings
        controls = (control,) if isinstance(control, str) else control or ()
        bad = (failed.get(latent) or next((failed[k] for k in controls if k in failed), None)
               or failed.get(audio or ""))
        if bad:
            if item.path not in reported:
                dropped.append((item.path, f"unreadable: {bad}"))
                reported.add(item.path)
            continue
        bucket = buckets.get(p.shape)
        if bucket is None:
            bucket = buckets[p.shape] = Bucket(
                p.shape.name, p.shape.width, p.shape.height, p.shape.frames, p.resolution,
                _micro_batch_size(cfg, p.resolution, p.shape.frames, layout.micro_batch_size))
        src_w, src_h = item.info["w"], item.info["h"]
        # Resized to cover the bucket: a source smaller than that on either side is enlarged.
        if p.shape.width > src_w or p.shape.height > src_h:
            directory = str(s.discovery.directories[item.directory].path)
            upscaled.setdefault(directory, {})[item.path] = (src_w, src_h)
        fps = (settings.video_fps or item.info.get("fps")) if item.kind == "video" else None
        bucket.samples.append(Sample(
            item.path, p.start, latent, texts, mask, control,
            1 if eval_mode else settings.num_repeats,
            0.0 if eval_mode else settings.caption_dropout, None if eval_mode else empty,
            (src_h, src_w), crop_top_left(src_w, src_h, p.shape.width, p.shape.height),
            None if fps is None else float(fps),
            None if eval_mode or settings.loss_weight == 1 else float(settings.loss_weight),
            True if settings.prior_preservation and not eval_mode else None, audio))
    if sound is not None:
        _check_audio_lengths(buckets.values(), sound.sample_rate)
    _check_reference_counts(buckets.values())
    ordered = sorted(buckets.values(), key=lambda b: (b.frames, b.resolution, b.name))
    report = DataReport(s.name, len(s.discovery.items), len(s.discovery.directories),
                        layout.micro_batches, layout.data_parallel)
    for b in ordered:
        batch = b.micro_batch_size * layout.data_parallel
        if b.size < batch and not eval_mode:  # eval batches the rest smaller (evaluate.py)
            report.warnings.append(
                f"bucket {b.name} has {b.size} sample(s), fewer than one batch of {batch} "
                f"(micro-batch {b.micro_batch_size} x {layout.data_parallel} data-parallel "
                f"rank(s)): they are never trained. Fix: add "
                f"files of this shape, raise num_repeats of their directories, add "
                f"{{resolution: {b.resolution}, micro_batch_size: 1}} to "
                f"dataset.micro_batch_sizes, or change the aspect buckets so they join a "
                f"neighbouring bucket.")
            dropped += [(src, f"bucket {b.name} is smaller than one batch (see the warning)")
                        for src in sorted({x.source for x in b.samples})]
    trainable = [b for b in ordered if b.size >= b.micro_batch_size * layout.data_parallel]
    if not trainable and not eval_mode and training:
        report.manifest = Manifest(ordered, empty_text)
        lines = "\n".join(report.lines())
        raise DataError(f"no bucket holds enough samples for one batch:\n{lines}")
    report.manifest = Manifest(ordered, empty_text if not eval_mode else None)
    report.notes = list(s.notes)
    if sound is not None and not eval_mode:
        silent = _no_sound_trained(s)
        if silent:
            report.warnings.append(
                f"model.audio=true, but {silent}, so the sound (the audio stream and its "
                "adapters) learns nothing from this dataset. Add clips with an audio track or a "
                "same-stem .wav/.flac, longer than one frame, or set model.audio=false")
    report.dropped, report.trimmed = dropped, trimmed
    report.silent = list(s.discovery.silent)
    report.upscaled = {d: (len(files), min(files.values(), key=lambda wh: (wh[0] * wh[1], wh)))
                       for d, files in sorted(upscaled.items())}
    return report.manifest, report


def _check_reference_counts(buckets) -> None:
    """A micro-batch stacks its samples' references, so the files of a bucket trained more than
    one to a micro-batch must have as many each."""
    for b in buckets:
        counts: dict[int, str] = {}
        for sample in b.samples:
            if sample.control:
                counts.setdefault(len(sample.control_keys), sample.source)
        if b.micro_batch_size > 1 and len(counts) > 1:
            listed = [f"{source}: {n} control image(s)" for n, source in sorted(counts.items())]
            raise DataError(
                f"bucket {b.name} (micro-batch {b.micro_batch_size}) mixes files with "
                f"{' and '.join(map(str, sorted(counts)))} control images, which a micro-batch "
                "cannot stack, e.g.:" + list_files(listed) + "\nGive its files as many "
                f"each, or add {{resolution: {b.resolution}, micro_batch_size: 1}} to "
                "dataset.micro_batch_sizes.")


def _no_sound_trained(s: _Set) -> str | None:
    """Why no sample of the set trains on real sound (not silence), or None if some do."""
    items = s.discovery.items
    if any(audio and items[p.item].audio.origin != "silence"
           for p, (*_, audio) in zip(s.placements, s.sample_keys)):
        return None
    clips = [i for i in items if i.kind == "video"]
    voiced = [i for i in clips if i.audio is not None and i.audio.origin != "silence"]
    if not clips:
        return "the dataset has no clips"
    if not voiced:
        return f"none of its {len(clips)} clip(s) has sound (they train on silence)"
    return f"its {len(voiced)} clip(s) with sound are cut to one frame (dataset.frame_buckets)"


def _check_audio_lengths(buckets, rate: int) -> None:
    """A micro-batch stacks its clips' audio latents, so the clips of a bucket must last as
    long: the same frame count at different rates (video_fps=null keeps each clip's) does not."""
    for b in buckets:
        rates = sorted({s.fps for s in b.samples if s.audio})
        if len({sample_count(b.frames, fps, rate) for fps in rates}) > 1:
            files = [f"{s.source} ({s.fps:g} fps)" for fps in rates[:3]
                     for s in b.samples if s.audio and s.fps == fps][:3]
            raise DataError(
                f"bucket {b.name}: its clips play at different frame rates "
                f"({', '.join(f'{r:g}' for r in rates)} fps), so their sound lasts differently "
                "long and cannot be batched:" + list_files(files) + "\nSet dataset.video_fps "
                "(or video_fps of their directories) to one rate.")


def _micro_batch_size(cfg: DatasetConfig, resolution: int, frames: int, default: int) -> int:
    for rule in cfg.micro_batch_sizes:
        if rule.resolution == resolution and rule.frames in (None, frames):
            return rule.micro_batch_size
    return default


def _broadcast(make):
    """Runs `make` on rank 0 (the others pass a no-op) and gives its result, or its user error,
    to every rank."""
    try:
        value = make()
    except UserError as error:
        value = error
    if dist.is_initialized():
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    if isinstance(value, UserError):
        raise value
    return value


def _gather(values: list) -> list:
    if not dist.is_initialized():
        return list(values)
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(values))
    return [v for part in out for v in part]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
