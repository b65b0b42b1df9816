"""From the dataset config to a list of usable files: directories, captions, masks, controls.

Everything that can be wrong with the input is found here, before any encoding: a missing or
empty directory, captions missing (per `missing_caption`), unreadable files (skipped and listed,
or an error in strict mode), masks and control images missing or of another size than their
image (an error naming the files). Nothing is dropped without a line in the dataset report.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NamedTuple

from dpipe.config.schema import AudioMissing, DataSettings, DatasetConfig, MissingCaption
from dpipe.data.audio import AudioSource
from dpipe.data.buckets import (
    Shape, aspect_ratios, bucket_sizes, clip_starts, frame_bucket, nearest_size)
from dpipe.data.captions import (
    CaptionsFile, caption_variants, load_captions_file, match_captions)
from dpipe.data.index import FileIndex
from dpipe.data.sources import (
    FoundFile, check_directory, image_extensions, list_files, same_stem_files, walk)
from dpipe.images import crop_fraction
from dpipe.data.video import timeline_length
from dpipe.errors import DataError

# Crops that cut away more than this share of a file are listed one by one in the report.
CROP_REPORTED = 0.10


@dataclass(frozen=True)
class Directory:
    path: Path
    settings: DataSettings


@dataclass
class Item:
    """One usable media file and everything its samples need."""

    path: str
    kind: str  # "image" or "video"
    sha256: str
    info: dict  # the index record: w, h (as shown); videos: frames, fps, duration
    captions: list[str]  # every caption variant, final (prefix, shuffled tags)
    directory: int
    mask: tuple[str, str] | None = None  # (path, sha256)
    # (path, sha256) of each control (reference) image, in order; () without a control_dir.
    controls: tuple[tuple[str, str], ...] = ()
    audio: AudioSource | None = None  # clips, when the model trains on sound
    # (path, sha256) of the image that is a clip's first / last frame (first_frame_dir,
    # last_frame_dir), in place of its own.
    first_frame: tuple[str, str] | None = None
    last_frame: tuple[str, str] | None = None


@dataclass
class Discovery:
    directories: list[Directory]
    items: list[Item] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (file, why)
    silent: list[tuple[str, str]] = field(default_factory=list)  # clips trained on silence
    reads: int = 0  # files read this time (0 when every file is known to the index)
    files: int = 0


class Placement(NamedTuple):
    """One sample of an item: its bucket, resolution and (videos) first frame."""

    item: int
    shape: Shape
    resolution: int
    start: int = 0


def directories(cfg: DatasetConfig, entries: list | None = None) -> list[Directory]:
    """The dataset's directories with their settings resolved (the eval set's if `entries`)."""
    base = {f.name: getattr(cfg, f.name) for f in fields(DataSettings)}
    if entries is None:
        entries = ([{"path": cfg.path}] if cfg.path else []) + list(cfg.directories)
    out = []
    for entry in entries:
        get = entry.get if isinstance(entry, dict) else lambda k, d=None, e=entry: getattr(e, k, d)
        overrides = {k: get(k) for k in base if get(k) is not None}
        path = Path(get("path")).expanduser()
        out.append(Directory(path, DataSettings(**{**base, **overrides})))
    return out


def _inside(root: Path, sub: str | None) -> Path | None:
    return None if sub is None else (root / Path(sub).expanduser())


def discover(dirs: list[Directory], cache_dir: Path, strict: bool, eval_mode: bool = False,
             workers: int = 8, audio: bool = False) -> Discovery:
    """`audio`: the model trains on sound, so each clip gets its `AudioSource` (a same-stem
    .wav/.flac, its own track, or per `audio_missing` silence, a skip or an error)."""
    result = Discovery(dirs)
    problems: list[str] = []  # mask/control/caption errors: always fatal, reported together
    unreadable: list[tuple[str, str]] = []
    for number, d in enumerate(dirs):
        s = d.settings
        root = check_directory(d.path)
        mask_dir, control_dir = _inside(root, s.mask_dir), _inside(root, s.control_dir)
        first_dir, last_dir = _inside(root, s.first_frame_dir), _inside(root, s.last_frame_dir)
        listing = walk(root, exclude=tuple(p for p in (mask_dir, control_dir, first_dir, last_dir)
                                           if p))
        unreadable.extend(listing.unfollowable)  # skipped, and named, as unreadable files are
        media = [(f, "image") for f in listing.images] + [(f, "video") for f in listing.videos]
        media.sort(key=lambda fk: fk[0].rel)
        if not media:
            raise DataError(
                f"dataset directory {root} has no images or videos. Accepted: "
                + " ".join(sorted(image_extensions())) + " and videos (.mp4 .mov .webm .mkv ...)"
                + "; remove the directory from the config or add files.")
        index = FileIndex(cache_dir, root)
        records = dict(zip((f.rel for f in listing.images),
                           index.records(listing.images, "image", workers)))
        records.update(zip((f.rel for f in listing.videos),
                           index.records(listing.videos, "video", workers)))
        stems = [os.path.splitext(f.rel)[0] for f, _ in media]
        texts = [listing.texts[st] for st in stems if st in listing.texts]
        text_records = dict(zip((t.rel for t in texts), index.records(texts, "text", workers)))
        sidecars = [listing.audio[st] for (f, kind), st in zip(media, stems)
                    if audio and kind == "video" and st in listing.audio]
        sidecar_records = dict(zip((a.rel for a in sidecars),
                                   index.records(sidecars, "audio", workers)))
        listed = (load_captions_file(root / s.captions_file) if s.captions_file
                  else CaptionsFile({}, {}))
        table = listed.captions
        masks = _companions(mask_dir, "mask_dir", cache_dir, workers, problems)
        controls = _companions(control_dir, "control_dir", cache_dir, workers, problems)
        firsts = _companions(first_dir, "first_frame_dir", cache_dir, workers, problems)
        lasts = _companions(last_dir, "last_frame_dir", cache_dir, workers, problems)
        numbered = _numbered(controls, set(stems))
        result.reads += index.reads
        result.files += len(media)

        for (f, kind), stem in zip(media, stems):
            record = records[f.rel]
            if "error" in record:
                unreadable.append((f.path, record["error"]))
                continue
            captions = match_captions(table, f.rel) if table else None
            if captions is None and stem in listing.texts:
                text = text_records[listing.texts[stem].rel]
                if "error" in text:
                    problems.append(text["error"])
                    continue
                captions = [text["text"]]
            if captions is None:
                if s.missing_caption == MissingCaption.error:
                    problems.append(f"{f.path}: no caption (no {stem}.txt"
                                    + (f", not in {s.captions_file}" if table else "") + ")")
                    continue
                if s.missing_caption == MissingCaption.skip:
                    result.dropped.append((f.path, "no caption (missing_caption=skip)"))
                    continue
                captions = [""]
            item = Item(f.path, kind, record["sha256"], record, [], number)
            item.captions = (caption_variants(captions[:1], s.caption_prefix, False, 1, 0, ",")
                             if eval_mode else
                             caption_variants(captions, s.caption_prefix, s.shuffle_tags,
                                              s.tag_variants, s.keep_tags, s.tag_separator))
            item.mask = _companion(masks, stem, f, item, "mask", mask_dir, problems)
            named = match_captions(listed.controls, f.rel) if listed.controls else None
            if named is None:
                item.controls = _references(controls, numbered, stem, f, item, control_dir,
                                            problems)
            else:
                item.controls = _listed_references(named, controls, f, item, control_dir,
                                                   root / s.captions_file, problems)
            if kind == "video":  # an image is its own first and last frame
                item.first_frame = _companion(firsts, stem, f, item, "first frame", first_dir,
                                              problems, same_size=False)
                item.last_frame = _companion(lasts, stem, f, item, "last frame", last_dir,
                                             problems, same_size=False)
            if audio and kind == "video":
                sidecar = listing.audio.get(stem)
                item.audio = _sound(f.path, record, sidecar,
                                    sidecar and sidecar_records[sidecar.rel], s, result,
                                    problems, unreadable)
                if item.audio is None:
                    continue
            result.items.append(item)
        index.save()

    if problems:
        raise DataError(f"{len(problems)} problem(s) with the dataset's files:"
                        + list_files(problems) + "\nFix or remove these files, then start again.")
    if unreadable:
        if strict:
            raise DataError(
                f"{len(unreadable)} file(s) cannot be read (dataset.strict=true):"
                + list_files([f"{p}: {why}" for p, why in unreadable])
                + "\nReplace or delete them, or set dataset.strict=false to skip them.")
        result.dropped.extend((p, f"unreadable: {why}") for p, why in unreadable)
    return result


def placements(disc: Discovery, multiple: int) -> tuple[list[Placement], list[tuple[str, str]],
                                                        list[tuple[str, str]]]:
    """Every sample of every item, plus (file, why) of files dropped and of files trimmed."""
    out: list[Placement] = []
    dropped: list[tuple[str, str]] = []
    trimmed: list[tuple[str, str]] = []
    ratio_cache: dict[int, tuple[float, ...]] = {}
    fit_cache: dict[tuple, tuple[int, int, float]] = {}
    for number, item in enumerate(disc.items):
        s = disc.directories[item.directory].settings
        frames, starts = 1, [0]
        if item.kind == "video":
            available = timeline_length(item.info, s.video_fps)
            rate = f" at {s.video_fps:g} fps" if s.video_fps else ""
            frames = frame_bucket(available, s.frame_buckets)
            if frames is None:
                dropped.append((item.path, f"{available} frames{rate}, shorter than every frame "
                                f"bucket {sorted(s.frame_buckets)}"))
                continue
            starts = clip_starts(available, frames, s.clip_selection, s.clips_per_video)
            used = len({f for st in starts for f in range(st, st + frames)})
            if used < available:
                trimmed.append((item.path, f"uses {used} of its {available} frames{rate} "
                                f"({len(starts)} clip(s) of {frames}, {s.clip_selection.value})"))
        ratios = ratio_cache.get(item.directory)
        if ratios is None:
            ratios = ratio_cache[item.directory] = tuple(aspect_ratios(s))
        w, h = item.info["w"], item.info["h"]
        for resolution in s.resolutions:
            # Most datasets have few distinct sizes: fit each (size, buckets) once.
            key = (w, h, resolution, ratios)
            if key not in fit_cache:
                sizes = bucket_sizes(resolution, list(ratios), multiple)
                bw, bh = nearest_size(sizes, w, h)
                fit_cache[key] = bw, bh, crop_fraction(w, h, bw, bh)
            bw, bh, cut = fit_cache[key]
            if cut > CROP_REPORTED:
                trimmed.append((item.path, f"{cut:.0%} cropped away to fit {bw}x{bh} "
                                f"(aspect {w / h:.2f}; buckets {min(ratios):.2f}-{max(ratios):.2f})"))
            shape = Shape(bw, bh, frames)
            for start in starts:
                out.append(Placement(number, shape, resolution, start))
    return out, dropped, trimmed


def _sound(path: str, record: dict, sidecar: FoundFile | None, sidecar_record: dict | None,
           s: DataSettings, result: Discovery, problems: list[str],
           unreadable: list[tuple[str, str]]) -> AudioSource | None:
    """Where a clip's sound comes from; None where the clip is left out (noted where it goes)."""
    if sidecar is not None:
        if "error" in sidecar_record:
            unreadable.append((path, f"its sound {sidecar.path}: {sidecar_record['error']}"))
            return None
        return AudioSource("sidecar", sidecar.path, sidecar_record["sha256"])
    if record.get("audio"):
        return AudioSource("track", path, record["sha256"])
    why = "no audio track and no same-stem .wav/.flac"
    if s.audio_missing == AudioMissing.error:
        problems.append(f"{path}: {why} (audio_missing=error; set audio_missing to silence or "
                        "skip, or add the sound)")
        return None
    if s.audio_missing == AudioMissing.skip:
        result.dropped.append((path, f"{why} (audio_missing=skip)"))
        return None
    result.silent.append((path, f"{why}: trains on silence (audio_missing=silence)"))
    return AudioSource("silence", None, None)


def _companions(folder: Path | None, key: str, cache_dir: Path, workers: int,
                problems: list[str]) -> dict[str, tuple[FoundFile, dict]] | None:
    if folder is None:
        return None
    if not folder.is_dir():
        problems.append(f"{folder}: the {key} folder does not exist")
        return {}
    found = same_stem_files(folder)
    index = FileIndex(cache_dir, folder)
    files = list(found.values())
    records = index.records(files, "image", workers)
    index.save()
    return {stem: (f, r) for (stem, f), r in zip(found.items(), records)}


def _numbered(table, media_stems: set[str]) -> dict[str, list[int]]:
    """Stem -> the numbers of its numbered control images (`photo_2.png`: "photo" -> [2]), other
    than those that are some media file's own same-stem control image."""
    out: dict[str, list[int]] = {}
    for name in table or ():
        match = re.fullmatch(r"(.+)_(\d+)", name)
        if match and name not in media_stems:
            out.setdefault(match.group(1), []).append(int(match.group(2)))
    return out


def _references(table, numbered: dict[str, list[int]], stem: str, f: FoundFile, item: Item,
                folder: Path | None, problems: list[str]) -> tuple[tuple[str, str], ...]:
    """An item's control images: the same-stem file (`photo.png` for `photo.jpg`), else the
    numbered ones in order (`photo_1.png`, `photo_2.png`, ...: a gap in the numbers is an
    error, not a cut)."""
    if table is None:
        return ()
    stems = [stem]
    if stem not in table:
        stems = list(itertools.takewhile(table.__contains__,
                                         (f"{stem}_{n}" for n in itertools.count(1))))
        beyond = sorted(n for n in numbered.get(stem, ()) if n > len(stems))
        if beyond:
            problems.append(f"{f.path}: its control images in {folder} skip a number ("
                            + ", ".join(f"{stem}_{n}" for n in beyond) + f" after "
                            f"{len(stems)} in order): number them {stem}_1, {stem}_2, ...")
            return ()
    if not stems:
        problems.append(f"{f.path}: no control image in {folder} (expected {stem}.<image "
                        f"extension>, or {stem}_1, {stem}_2, ... for several)")
        return ()
    found = [_companion(table, s, f, item, "control image", folder, problems) for s in stems]
    return tuple(found) if all(found) else ()


def _listed_references(names: list[str], table, f: FoundFile, item: Item, folder: Path | None,
                       captions_file: Path, problems: list[str]) -> tuple[tuple[str, str], ...]:
    """An item's control images as its captions file names them, in that order (paths inside
    control_dir, with their extension)."""
    if table is None:
        problems.append(f"{captions_file} names control images for {f.path}: set control_dir to "
                        "the folder that holds them")
        return ()
    found = []
    for name in names:
        stem, _suffix = os.path.splitext(name)
        hit = table.get(stem)
        if hit is None or os.path.basename(hit[0].path) != os.path.basename(name):
            problems.append(f"{f.path}: its control image {name} (in {captions_file}) is not in "
                            f"{folder}")
            continue
        found.append(_companion(table, stem, f, item, "control image", folder, problems))
    return tuple(found) if len(found) == len(names) and all(found) else ()


def _companion(table, stem: str, f: FoundFile, item: Item, what: str, folder: Path | None,
               problems: list[str], same_size: bool = True) -> tuple[str, str] | None:
    """(path, sha256) of a file's same-stem companion in `folder`'s `table`; a missing one,
    an unreadable one, or (`same_size`: masks) one of another size is a problem."""
    if table is None:
        return None
    hit = table.get(stem)
    if hit is None:
        problems.append(f"{f.path}: no {what} in {folder} (expected {stem}.<image extension>)")
        return None
    other, record = hit
    if "error" in record:
        problems.append(record["error"])
        return None
    if same_size and (record["w"], record["h"]) != (item.info["w"], item.info["h"]):
        problems.append(f"{other.path}: the {what} is {record['w']}x{record['h']} but its image "
                        f"{f.path} is {item.info['w']}x{item.info['h']}; they must match")
        return None
    return other.path, record["sha256"]
