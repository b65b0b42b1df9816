"""What a round of samples leaves: `<dir>/<k>.png` (video: `<k>.mp4` at the family's frame
rate, with its soundtrack in AAC where the family makes sound, and its first frame as
`<k>.poster.png`; a one-frame clip is a PNG) and
`prompts.json` (what each file shows), optionally `<k>.safetensors` with the final latents, the
same pictures (and sound) in TensorBoard under `samples/<k>`, and `index.html`, a page with the
prompts as rows and the rounds as columns that a browser opens from disk (no server, nothing
fetched), every picture 256 pixels wide (a tiny model's 64-pixel samples enlarged, their pixels
kept sharp).

Every file is written atomically: a run killed while writing leaves the old file or none, and a
resumed run that samples a step again writes the same names.
"""

from __future__ import annotations

import html
import io
import json
import re
from pathlib import Path

import torch

from dpipe.io import atomic_write_bytes, atomic_write_text
from dpipe.models.sampling import SampleRequest

PROMPTS_FILE = "prompts.json"
INDEX_FILE = "index.html"


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1] -> uint8, rounded as diffusers' image processor rounds."""
    return ((pixels.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def png_bytes(frame: torch.Tensor) -> bytes:
    """(3, H, W) uint8 -> a PNG file's bytes."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(frame.permute(1, 2, 0).contiguous().numpy()).save(out, format="PNG")
    return out.getvalue()


def mp4_bytes(frames: torch.Tensor, fps: float,
              audio: tuple[torch.Tensor, int] | None = None) -> bytes:
    """(F, 3, H, W) uint8 -> an H.264 MP4 file's bytes (yuv420p, which every player opens; its
    sides must be even, so an odd last row or column is dropped); with `audio`, (waveform
    (channels, samples) in [-1, 1], sample rate), its soundtrack in AAC (`SOUND_CODEC`)."""
    from fractions import Fraction

    import av

    f, _, h, w = frames.shape
    h, w = h - h % 2, w - w % 2
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"crf": "18"}
        sound = None if audio is None else _add_sound(container, *audio)
        for frame in frames[:, :, :h, :w]:
            image = av.VideoFrame.from_ndarray(frame.permute(1, 2, 0).contiguous().numpy(),
                                               format="rgb24")
            for packet in stream.encode(image):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            sound()
    return out.getvalue()


# AAC (FFmpeg's native encoder, in PyAV's wheels): what MP4 players and every browser play.
SOUND_CODEC, SOUND_BITRATE = "aac", 192_000


def _add_sound(container, waveform: torch.Tensor, rate: int):
    """Adds the soundtrack's stream to `container`; returns what encodes and muxes it (after
    the video's packets: the muxer interleaves them by time)."""
    import av

    channels = waveform.shape[0]
    if channels not in (1, 2):
        raise ValueError(f"a soundtrack of {channels} channels: mono or stereo are written")
    layout = "stereo" if channels == 2 else "mono"
    stream = container.add_stream(SOUND_CODEC, rate=int(rate), layout=layout)
    stream.bit_rate = SOUND_BITRATE
    planar = waveform.float().clamp(-1, 1).contiguous().numpy()

    def encode() -> None:
        frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout=layout)
        frame.sample_rate, frame.pts = int(rate), 0
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)

    return encode


def write_sample(out_dir: Path, request: SampleRequest, pixels: torch.Tensor, fps: float,
                 latents: torch.Tensor | None = None,
                 audio: tuple[torch.Tensor, int] | None = None) -> Path:
    """One sample's file(s); `pixels` (3, H, W) or (3, F, H, W) in [-1, 1]; `audio`, a clip's
    soundtrack (waveform (channels, samples) in [-1, 1], sample rate), goes into its .mp4 (a
    one-frame sample is a PNG, which holds none). Returns the picture."""
    frames = to_uint8(pixels)
    if frames.ndim == 4 and frames.shape[1] == 1:
        frames = frames[:, 0]
    if frames.ndim == 3:
        path = out_dir / f"{request.index}.png"
        atomic_write_bytes(path, png_bytes(frames))
    else:
        path = out_dir / f"{request.index}.mp4"
        atomic_write_bytes(path, mp4_bytes(frames.permute(1, 0, 2, 3), fps, audio))
        # What the index page shows before the clip plays (a browser's own choice is often black).
        atomic_write_bytes(poster_path(path), png_bytes(frames[:, 0]))
    if latents is not None:
        from safetensors.torch import save

        atomic_write_bytes(out_dir / f"{request.index}.safetensors",
                           save({"latents": latents.float().cpu().contiguous()},
                                metadata={"prompt": request.prompt, "seed": str(request.seed)}))
    return path


def poster_path(clip: Path) -> Path:
    """A clip's first frame, as a PNG beside it: `<k>.mp4` -> `<k>.poster.png`."""
    return clip.with_suffix(".poster.png")


def has_sound(path: Path) -> bool:
    """Whether a written clip has a soundtrack (False for one FFmpeg cannot open: the page
    still links it)."""
    import av

    try:
        with av.open(str(path)) as container:
            return bool(container.streams.audio)
    except av.error.FFmpegError:
        return False


def add_to_tensorboard(writer, request: SampleRequest, pixels: torch.Tensor, fps: float,
                       step: int, audio: tuple[torch.Tensor, int] | None = None) -> None:
    """An image, or a clip as an animated GIF (what SummaryWriter.add_video writes, without its
    moviepy dependency), tagged samples/<k>; a soundtrack as audio under samples/<k>/sound
    (TensorBoard plays one channel: the channels' mean)."""
    frames = to_uint8(pixels)
    tag = f"samples/{request.index}"
    if audio is not None:
        waveform, rate = audio
        writer.add_audio(f"{tag}/sound", waveform.float().mean(0).clamp(-1, 1), step,
                         sample_rate=int(rate))
    if frames.ndim == 4 and frames.shape[1] == 1:
        frames = frames[:, 0]
    if frames.ndim == 3:
        writer.add_image(tag, frames, step)
        return
    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    pictures = [Image.fromarray(f.permute(1, 2, 0).contiguous().numpy())
                for f in frames.permute(1, 0, 2, 3)]
    out = io.BytesIO()
    pictures[0].save(out, format="GIF", save_all=True, append_images=pictures[1:],
                     duration=max(1, round(1000 / fps)), loop=0)
    image = Summary.Image(height=frames.shape[2], width=frames.shape[3], colorspace=3,
                          encoded_image_string=out.getvalue())
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]),
                                          step)


def write_prompts(folder: Path, requests: list[SampleRequest]) -> None:
    """A round's record of what its files show: index -> the request's label."""
    atomic_write_text(folder / PROMPTS_FILE, json.dumps(
        [{"index": r.index, "label": r.label, "prompt": r.prompt, "seed": r.seed,
          "size": [r.width, r.height], "frames": r.frames,
          **({} if r.audio_guidance is None else {"audio_guidance": r.audio_guidance})}
         for r in requests], indent=1))


def write_index(index_dir: Path, rounds: list[Path] | None = None) -> Path:
    """Rewrites the index page of `index_dir`: a column per round folder (default: its
    `step_<N>` folders in step order, as training writes them), a row per prompt that any round
    sampled (each round's prompts.json says which of its files shows which: a resumed run may
    have changed sample.prompts)."""
    if rounds is None:
        rounds = sorted((d for d in index_dir.iterdir() if d.is_dir() and _step(d) is not None),
                        key=_step)
    shown: dict[str, dict[Path, int]] = {}  # label -> {round: file index}
    for d in rounds:
        listed = d / PROMPTS_FILE
        for item in json.loads(listed.read_text()) if listed.is_file() else []:
            shown.setdefault(item["label"], {})[d] = item["index"]
    head = "".join(f"<th>{html.escape(d.name)}</th>" for d in rounds)
    rows = []
    for label, files in shown.items():
        cells = []
        for d in rounds:
            index = files.get(d)
            found = [] if index is None else [
                p for p in (d / f"{index}.png", d / f"{index}.mp4") if p.is_file()]
            link = "" if not found else html.escape(str(found[0].relative_to(index_dir)))
            if not found:
                cells.append("<td></td>")
            elif found[0].suffix == ".png":
                cells.append(f'<td><a href="{link}"><img src="{link}" loading="lazy"></a></td>')
            else:
                muted = "" if has_sound(found[0]) else " muted"  # never silence a soundtrack
                poster = poster_path(found[0])
                poster = "" if not poster.is_file() else \
                    f' poster="{html.escape(str(poster.relative_to(index_dir)))}"'
                cells.append(f'<td><video src="{link}"{poster} controls loop{muted}></video></td>')
        rows.append(f'<tr><th class="prompt">{html.escape(label)}</th>{"".join(cells)}</tr>')
    title = html.escape(index_dir.parent.name if index_dir.name == "samples" else index_dir.name)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>samples: {title}</title>
<style>
body {{ font-family: sans-serif; margin: 1em; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 4px; vertical-align: top; }}
th.prompt {{ max-width: 16em; text-align: left; font-weight: normal; }}
img, video {{ width: 256px; height: auto; image-rendering: pixelated; }}
</style></head><body>
<h1>{title}</h1>
<table><tr><th>prompt</th>{head}</tr>
{chr(10).join(rows)}
</table></body></html>
"""
    path = index_dir / INDEX_FILE
    atomic_write_text(path, page)
    return path


def _step(folder: Path) -> int | None:
    match = re.fullmatch(r"step_(\d+)", folder.name)
    return int(match.group(1)) if match else None
