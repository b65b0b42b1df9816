"""Videos through PyAV (its wheels carry ffmpeg): probing, and decoding a clip at a frame rate.

A clip is addressed in the video's *timeline at the target rate*: with `video_fps` set, frame k
of the timeline is the source frame shown at time k / fps (the last one that started by then);
without it, frame k is the k-th decoded frame.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dpipe.data.audio import track_of
from dpipe.images import fit, to_tensor
from dpipe.errors import DataError

_EPS = 1e-6


def _open(path: Path):
    import av

    try:
        return av.open(str(path))
    except (av.error.FFmpegError, OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read video {path} ({error}): replace or delete the file.") from None


def probe_video(path: Path) -> dict:
    """{"w", "h", "frames", "fps", "duration", "audio"} from the container ("audio": [sample
    rate, channels] of its first audio track, or None); raises DataError.

    Frame counts missing from the header (some WebM/MKV files) are counted by demuxing packets,
    which reads the file but decodes nothing.
    """
    import av

    with _open(path) as container:
        if not container.streams.video:
            raise DataError(f"{path} has no video stream: delete it or convert it.")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        if not rate or not stream.width or not stream.height:
            raise DataError(f"cannot read video {path} (no frame rate or size): re-encode it.")
        frames = stream.frames
        try:
            if not frames:
                frames = sum(1 for packet in container.demux(stream) if packet.size)
        except av.error.FFmpegError as error:
            raise DataError(f"cannot read video {path} ({error}): replace or delete it.") from None
        fps = float(rate)
        return {"w": stream.width, "h": stream.height, "frames": int(frames), "fps": fps,
                "duration": frames / fps, "audio": track_of(container)}


def timeline_length(info: dict, fps: float | None) -> int:
    """How many frames the video has at the target rate (all of them without one): the times
    0, 1/fps, 2/fps, ... that fall before its end."""
    if fps is None:
        return info["frames"]
    return max(0, math.ceil(info["duration"] * fps - _EPS))


def load_clip(path: Path, start: int, frames: int, fps: float | None, width: int,
              height: int) -> torch.Tensor:
    """Frames start .. start+frames-1 of the timeline, fitted to width x height (centre crop):
    float32 (3, frames, height, width) in [-1, 1]. Raises DataError if the file cannot give them."""
    import av

    out: list[torch.Tensor] = []
    try:
        with _open(path) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            if fps is None:
                for index, frame in enumerate(container.decode(stream)):
                    if index >= start:
                        out.append(_frame_tensor(frame, width, height))
                    if len(out) == frames:
                        break
            else:
                out = _resampled(container, stream, start, frames, fps, width, height)
    except av.error.FFmpegError as error:
        raise DataError(f"cannot decode video {path} ({error}): replace or delete it.") from None
    if len(out) < frames:
        raise DataError(
            f"video {path} ended after {len(out)} of the {frames} frames asked from frame {start}"
            f"{'' if fps is None else f' at {fps} fps'}: the file is shorter than its header says"
            " (truncated?); re-encode or delete it.")
    return torch.stack(out, dim=1)


def _resampled(container, stream, start, frames, fps, width, height) -> list[torch.Tensor]:
    """The frame shown at each time k / fps: the last one that started at or before it."""
    rate = Fraction(stream.average_rate or stream.guessed_rate)
    wanted = [k / Fraction(fps).limit_denominator(1_000_000) for k in range(start, start + frames)]
    offset = stream.start_time or 0
    out: list[torch.Tensor] = []
    prev, prev_tensor, prev_time = None, None, None
    for index, frame in enumerate(container.decode(stream)):
        time = (Fraction((frame.pts - offset) * stream.time_base) if frame.pts is not None
                else index / rate)
        while wanted and prev is not None and wanted[0] < time - _EPS:
            if prev_tensor is None:
                prev_tensor = _frame_tensor(prev, width, height)
            out.append(prev_tensor)
            wanted.pop(0)
        if not wanted:
            return out
        prev, prev_tensor, prev_time = frame, None, time
    # Past the last frame: it is shown until one source frame interval after it starts.
    while wanted and prev is not None and wanted[0] < prev_time + 1 / rate - _EPS:
        if prev_tensor is None:
            prev_tensor = _frame_tensor(prev, width, height)
        out.append(prev_tensor)
        wanted.pop(0)
    return out


def _frame_tensor(frame, width: int, height: int) -> torch.Tensor:
    image = Image.fromarray(np.asarray(frame.to_ndarray(format="rgb24")))
    return to_tensor(fit(image, width, height))
