"""What a run trains on: every sample in its bucket, by the cache keys of its tensors.

A manifest is fixed data (JSON), identified by its digest. The batch plan is a pure function of a
manifest, the seed and the step, so saving a manifest in the run dir is enough to replay an epoch
exactly later, even after the dataset's files have changed (the cache keeps the old entries).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple
from pathlib import Path

from dpipe.io import atomic_write_bytes


class Sample(NamedTuple):
    source: str  # the file
    start: int  # first frame of the clip (0 for images)
    latent: str  # cache keys ...
    texts: tuple[str, ...]  # ... one per caption variant
    mask: str | None = None
    # The control image's latents (key); a tuple of keys, in order, where the sample has several
    # references (a single one stays a string: manifests without several keep their digest).
    control: str | tuple[str, ...] | None = None
    repeats: int = 1
    dropout: float = 0.0  # probability of using the empty caption instead
    # The sample's own empty caption (key), for models whose text sees the control image (the
    # empty caption is then encoded with it); None: the manifest's `empty_text`.
    empty: str | None = None
    # How the file was fitted to its bucket, for models conditioned on it (SDXL's size/crop
    # ids): the source's (height, width) as shown, and the (top, left) offset of the crop in
    # the source scaled to cover the bucket. Both follow from the latent's key (source content,
    # bucket size, centre crop).
    original_size: tuple[int, int] | None = None
    crop_top_left: tuple[int, int] | None = None
    fps: float | None = None  # the clip's frame rate as trained (after resampling); None: image
    # The directory's `loss_weight` where it is not 1, and True for its `prior_preservation`
    # (None otherwise: manifests without them keep their digest).
    loss_weight: float | None = None
    prior: bool | None = None
    # The clip's audio latents (key), for models that train on sound; None otherwise.
    audio: str | None = None

    @property
    def identity(self) -> tuple[str, int]:
        return self.source, self.start

    @property
    def control_keys(self) -> tuple[str, ...]:
        """The keys of the sample's control images' latents, in order; () without any."""
        if self.control is None:
            return ()
        return (self.control,) if isinstance(self.control, str) else self.control


@dataclass
class Bucket:
    name: str  # "512x768", "512x512x33f"
    width: int
    height: int
    frames: int
    resolution: int
    micro_batch_size: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Samples per epoch (repeats counted)."""
        return sum(s.repeats for s in self.samples)


@dataclass
class Manifest:
    buckets: list[Bucket]
    empty_text: str | None = None  # key of the empty caption, if any sample drops captions

    def to_json(self) -> bytes:
        data = {"empty_text": self.empty_text, "buckets": [
            {"name": b.name, "width": b.width, "height": b.height, "frames": b.frames,
             "resolution": b.resolution, "micro_batch_size": b.micro_batch_size,
             "samples": [_row(s) for s in b.samples]}
            for b in self.buckets]}
        return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Manifest":
        data = json.loads(raw)
        buckets = []
        for b in data["buckets"]:
            samples = [_sample(row) for row in b.pop("samples")]
            buckets.append(Bucket(**b, samples=samples))
        return cls(buckets, data["empty_text"])

    @cached_property
    def digest(self) -> str:
        """Identifies the manifest (computed once: a manifest is not changed once built)."""
        return hashlib.sha256(self.to_json()).hexdigest()

    def keys(self) -> set[str]:
        """Every cache entry the manifest uses."""
        out = {self.empty_text} if self.empty_text else set()
        for b in self.buckets:
            for s in b.samples:
                out.add(s.latent)
                out.update(s.texts)
                out.update(k for k in (s.mask, s.empty, s.audio) if k)
                out.update(s.control_keys)
        return out

    def save(self, folder: Path) -> Path:
        path = folder / f"manifest-{self.digest[:16]}.json.gz"
        if not path.exists():
            atomic_write_bytes(path, gzip.compress(self.to_json(), compresslevel=1))
        return path

    @classmethod
    def load(cls, folder: Path, digest: str) -> "Manifest | None":
        path = folder / f"manifest-{digest[:16]}.json.gz"
        try:
            return cls.from_json(gzip.decompress(path.read_bytes()))
        except (OSError, ValueError, KeyError, TypeError):
            return None


_EXTRAS = Sample._fields[8:]  # written only when set: older manifests keep their digest


def _row(s: Sample) -> list:
    row = [s.source, s.start, s.latent, s.texts, s.mask, s.control, s.repeats, s.dropout]
    extras = {k: getattr(s, k) for k in _EXTRAS if getattr(s, k) is not None}
    return row + [extras] if extras else row


def _sample(row: list) -> Sample:
    src, start, lat, texts, mask, ctrl, rep, drop, *rest = row
    extras = rest[0] if rest else {}
    for k in ("original_size", "crop_top_left"):
        if extras.get(k) is not None:
            extras[k] = tuple(extras[k])
    ctrl = tuple(ctrl) if isinstance(ctrl, list) else ctrl
    return Sample(src, start, lat, tuple(texts), mask, ctrl, rep, drop, **extras)


def describe_changes(old: Manifest, new: Manifest, listed: int = 5) -> str:
    """What differs between two manifests, in words: files added, removed, changed, moved."""
    def index(m: Manifest):
        return {s.identity: (b.name, s) for b in m.buckets for s in b.samples}

    a, b = index(old), index(new)
    added = sorted(set(b) - set(a))
    removed = sorted(set(a) - set(b))
    changed = sorted(k for k in set(a) & set(b) if a[k][1] != b[k][1])
    moved = sorted(k for k in set(a) & set(b) if a[k][0] != b[k][0])
    parts = []
    for what, keys in (("added", added), ("removed", removed), ("changed", changed),
                       ("moved to another bucket", moved)):
        if keys:
            names = ", ".join(src + (f"@{start}" if start else "") for src, start in keys[:listed])
            more = f" and {len(keys) - listed} more" if len(keys) > listed else ""
            parts.append(f"{len(keys)} sample(s) {what} ({names}{more})")
    if not parts and old.digest != new.digest:
        parts.append("bucket settings changed (micro-batch sizes or caption settings)")
    return "; ".join(parts) or "nothing"
