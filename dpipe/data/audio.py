"""Sound for audio-video models: a clip's audio track (or a same-stem .wav/.flac next to it)
decoded through PyAV, resampled to the model's rate and channels, and cut to exactly the time span
of the frames the clip's bucket keeps.

Times are those of the video timeline (dpipe.data.video): frame k of a clip at `fps` is shown at
k / fps after the video's first frame, so the sound of frames start .. start+frames-1 is the
span [start / fps, (start + frames) / fps). A clip's own track is placed by its timestamps
relative to the video stream's start (containers may start the two streams apart); a sidecar file
starts at the video's first frame.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from dpipe.errors import DataError

AUDIO_EXTENSIONS = (".wav", ".flac")  # same-stem sidecars that replace a clip's track, in order
# Sound that ends at most this much before its clip's end is padded with silence: containers
# and codecs end tracks a codec frame or two early (an AAC frame is 21 ms at 48 kHz). A larger
# gap is bad input: the clip is reported unreadable (dropped, or an error with dataset.strict).
SHORT_SLACK_S = 0.1
# Part of every audio cache key: bump when the decoding, resampling or cutting changes.
AUDIO_DECODE_VERSION = 1


class AudioSource(NamedTuple):
    """Where a clip's sound comes from: its own track, a sidecar file, or silence
    (audio_missing=silence)."""

    origin: str  # "track", "sidecar" or "silence"
    path: str | None  # the file read (the clip or the sidecar); None for silence
    sha256: str | None  # its content fingerprint (part of the cache key)


def sample_count(frames: int, fps: float, rate: int) -> int:
    """Samples per channel of the sound of `frames` frames at `fps`."""
    return round(frames / fps * rate)


def probe_audio(path: Path) -> dict:
    """{"rate", "channels", "duration"} of an audio file's first audio stream; raises DataError."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise DataError(f"{path} has no audio stream: delete it or convert it.")
            stream = container.streams.audio[0]
            duration = (float(stream.duration * stream.time_base) if stream.duration
                        else float(container.duration or 0) / 1e6)
            return {"rate": int(stream.rate or 0), "channels": int(stream.channels or 0),
                    "duration": duration}
    except (av.error.FFmpegError, OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read audio {path} ({error}): replace or delete it.") from None


def track_of(container) -> list[int] | None:
    """[rate, channels] of an open video file's first audio stream, or None without one."""
    if not container.streams.audio:
        return None
    stream = container.streams.audio[0]
    return [int(stream.rate or 0), int(stream.channels or 0)]


def silence(frames: int, fps: float, rate: int, channels: int) -> torch.Tensor:
    return torch.zeros(channels, sample_count(frames, fps, rate))


def load_audio(source: AudioSource, start: int, frames: int, fps: float, rate: int,
               channels: int) -> torch.Tensor:
    """The sound of frames start .. start+frames-1 at `fps`: float32 (channels, samples) in
    [-1, 1] at `rate`, exactly `sample_count(frames, fps, rate)` samples. Raises DataError naming
    the file when its sound cannot be read, resampled, or ends too early."""
    import av

    if source.origin == "silence":
        return silence(frames, fps, rate, channels)
    path = source.path
    begin = start / fps
    wanted = sample_count(frames, fps, rate)
    try:
        with av.open(path) as container:
            if not container.streams.audio:
                raise DataError(f"{path} has no audio stream: add one, or a same-stem .wav or "
                                ".flac next to the clip, or set audio_missing.")
            stream = container.streams.audio[0]
            if not stream.rate or stream.rate <= 0 or not stream.channels:
                raise DataError(f"the audio of {path} has no usable sample rate or channel "
                                f"count ({stream.rate} Hz, {stream.channels} channels): re-encode "
                                "it (e.g. ffmpeg -i in -ar 48000 out.wav) or replace it.")
            zero = _video_start(container) if source.origin == "track" else 0.0
            offset, samples = _decoded(container, stream, rate, channels, zero,
                                       begin + frames / fps)
    except av.error.FFmpegError as error:
        raise DataError(f"cannot decode the audio of {path} ({error}): replace the file or "
                        "put a same-stem .wav/.flac next to the clip.") from None
    # Samples [first, first + wanted) of the timeline; the decoded sound starts at `offset` s.
    first = round((begin - offset) * rate)
    lead = max(0, -first)  # the track starts after the clip: silence until it does
    out = samples[:, max(0, first):max(0, first) + wanted - lead]
    if lead:
        out = np.concatenate([np.zeros((channels, lead), np.float32), out], axis=1)
    short = wanted - out.shape[1]
    if short > 0:
        if short > SHORT_SLACK_S * rate or lead > SHORT_SLACK_S * rate:
            have = offset + samples.shape[1] / rate
            raise DataError(
                f"the audio of {path} covers {max(offset, 0):.3f}-{have:.3f} s, but frames "
                f"{start}-{start + frames - 1} at {fps:g} fps need {begin:.3f}-"
                f"{begin + frames / fps:.3f} s: the sound is shorter than its clip (more than "
                f"{SHORT_SLACK_S} s is missing); replace it or trim the video to its sound.")
        out = np.concatenate([out, np.zeros((channels, short), np.float32)], axis=1)
    elif lead > SHORT_SLACK_S * rate:
        raise DataError(f"the audio of {path} starts {lead / rate:.3f} s after frame {start} "
                        f"at {fps:g} fps: the sound does not cover its clip; re-mux it in sync.")
    return torch.from_numpy(np.ascontiguousarray(out)).clamp_(-1.0, 1.0)


def _video_start(container) -> float:
    """Seconds of the container's timeline at which the clip's first frame is shown."""
    if not container.streams.video:
        return 0.0
    video = container.streams.video[0]
    return float((video.start_time or 0) * video.time_base)


def _decoded(container, stream, rate: int, channels: int, zero: float,
             until: float) -> tuple[float, np.ndarray]:
    """(start in s on the clip's timeline, float32 (channels, n)) of the stream resampled to
    `rate` and `channels`, decoded until `until` s (and a little past it)."""
    import av

    layouts = {1: "mono", 2: "stereo"}
    if channels not in layouts:
        raise DataError(f"the model asks for {channels} audio channels: dpipe mixes to 1 or 2")
    # Mono and stereo keep their channels through the resampler and are mixed here, at full
    # level (libswresample's mono -> stereo upmix is 3 dB quieter); other layouts (5.1, ...)
    # are mixed down by libswresample.
    own = stream.channels if stream.channels in layouts else channels
    resampler = av.AudioResampler(format="fltp", layout=layouts[own], rate=rate)
    parts: list[np.ndarray] = []
    offset = None
    for frame in container.decode(stream):
        if offset is None:
            offset = (float(frame.pts * frame.time_base) - zero) if frame.pts is not None else 0.0
        for out in resampler.resample(frame):
            parts.append(out.to_ndarray())
        if frame.pts is not None and float(frame.pts * frame.time_base) - zero > until + 1.0:
            break
    for out in resampler.resample(None):  # what the resampler still holds
        parts.append(out.to_ndarray())
    if offset is None:
        raise DataError(f"{container.name}: the audio stream holds no sound; replace it, or "
                        "set audio_missing and remove the stream")
    samples = np.concatenate(parts, axis=1) if parts else np.zeros((own, 0), np.float32)
    if own != channels:  # mono -> both channels, stereo -> their mean
        samples = (np.repeat(samples, channels, axis=0) if own == 1
                   else samples.mean(axis=0, keepdims=True))
    return offset, samples.astype(np.float32, copy=False)
