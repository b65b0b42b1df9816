"""Buckets: the shapes samples are trained at, and which bucket and clips each file gives.

A resolution r is a target area (r x r pixels). Each aspect ratio a gives the size
(r * sqrt(a), r / sqrt(a)), both sides rounded to the model's pixel multiple; a file goes to the
bucket of its resolution whose ratio is nearest its own (in log scale: 2:1 is as far from 1:1 as
1:2) and is scaled to cover it, then centre-cropped. Videos also get a frame bucket: the longest
one their timeline fills, and one or more clips of that length.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

from dpipe.config.schema import ClipSelection, DataSettings
from dpipe.errors import ConfigError


class Shape(NamedTuple):
    width: int
    height: int
    frames: int = 1  # 1 for images

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.frames}f" if self.frames > 1 else "")


def aspect_ratios(s: DataSettings) -> list[float]:
    if s.aspect_ratios:
        return sorted(set(float(a) for a in s.aspect_ratios))
    n, lo, hi = s.num_aspect_buckets, s.min_aspect_ratio, s.max_aspect_ratio
    if n == 1:
        return [math.sqrt(lo * hi)]
    return [math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / (n - 1)) for i in range(n)]


def bucket_sizes(resolution: int, ratios: list[float], multiple: int) -> list[tuple[int, int]]:
    """Distinct (width, height) of one resolution, by increasing aspect ratio."""
    if resolution < multiple:
        raise ConfigError(f"dataset resolution {resolution} is smaller than the model's pixel "
                          f"multiple {multiple}: use {multiple} or more")
    sizes = []
    for a in ratios:
        w = max(multiple, round(resolution * math.sqrt(a) / multiple) * multiple)
        h = max(multiple, round(resolution / math.sqrt(a) / multiple) * multiple)
        if (w, h) not in sizes:
            sizes.append((w, h))
    return sorted(sizes, key=lambda wh: wh[0] / wh[1])


def nearest_size(sizes: list[tuple[int, int]], width: int, height: int) -> tuple[int, int]:
    target = math.log(width / height)
    return min(sizes, key=lambda wh: abs(math.log(wh[0] / wh[1]) - target))


def frame_bucket(available: int, buckets: list[int]) -> int | None:
    """The longest frame bucket the clip fills, or None if it is shorter than all of them."""
    fitting = [f for f in buckets if f <= available]
    return max(fitting) if fitting else None


# The longest clip that `frame_buckets: null` chooses: the length Wan and Cosmos sample at, a few
# seconds of video; longer clips need memory that only a chosen preset knows it has.
AUTO_MAX_FRAMES = 81


def frames_from_clips(lengths: list[int], clip_frames: Callable[[int], int]) -> list[int]:
    """The frame buckets of a directory whose `frame_buckets` is null: images, and the longest
    clip (at most AUTO_MAX_FRAMES) that every one of its clips fills and the family takes
    (`clip_frames(n)`: the longest valid count <= n, e.g. 4k+1). [1] without clips."""
    if not lengths:
        return [1]
    frames = clip_frames(min(min(lengths), AUTO_MAX_FRAMES))
    return [1] if frames <= 1 else [1, frames]


def clip_starts(available: int, frames: int, mode: ClipSelection, count: int) -> list[int]:
    """First frame of each clip of `frames` frames taken from a timeline of `available`."""
    slack = available - frames
    if mode == ClipSelection.beginning:
        return [0]
    if mode == ClipSelection.middle:
        return [slack // 2]
    if count == 1:
        return [slack // 2]
    starts = []
    for i in range(count):
        start = round(slack * i / (count - 1))
        if start not in starts:
            starts.append(start)
    return starts
