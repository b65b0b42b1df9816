"""What a round writes (PNG, MP4, TensorBoard, the index page), and a failing sample costing
only itself."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from dpipe.models.sampling import SampleRequest
from dpipe.sample import outputs


def request(index=0, frames=1) -> SampleRequest:
    return SampleRequest(index, f"prompt <{index}>", "", 1, 16, 8, frames)


def test_a_png_holds_the_pixels_rounded_as_diffusers_rounds(tmp_path):
    from PIL import Image

    pixels = torch.linspace(-1.2, 1.2, 3 * 8 * 16).reshape(3, 8, 16)
    path = outputs.write_sample(tmp_path, request(), pixels, 24.0)
    png = np.asarray(Image.open(path))
    expected = np.clip(pixels.permute(1, 2, 0).numpy() / 2 + 0.5, 0, 1)
    assert (png == (expected * 255).round().astype(np.uint8)).all()


def test_a_clip_is_an_mp4_at_the_familys_rate_and_one_frame_a_png(tmp_path):
    import av

    clip = torch.rand(3, 5, 8, 16) * 2 - 1
    path = outputs.write_sample(tmp_path, request(0, 5), clip, 16.0)
    assert path.name == "0.mp4"
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
        assert len(frames) == 5 and (frames[0].width, frames[0].height) == (16, 8)
        assert float(stream.average_rate) == 16.0
    single = outputs.write_sample(tmp_path, request(1, 1), clip[:, :1], 16.0)
    assert single.name == "1.png"


def tone(rate: int, seconds: float, channels: int) -> torch.Tensor:
    """(channels, samples): 440 Hz and, in a second channel, 660 Hz, at half scale."""
    t = torch.arange(round(rate * seconds)) / rate
    return torch.stack([0.5 * torch.sin(2 * torch.pi * f * t) for f in (440, 660)][:channels])


@pytest.mark.parametrize("rate, channels", [(24000, 2), (16000, 1)])
def test_a_clip_with_sound_carries_it_in_aac(tmp_path, rate, channels):
    """The .mp4 has the video and an AAC track at the waveform's rate and channel count, as long
    as the waveform; decoded, it is the waveform (AAC is lossy: close, not equal)."""
    import av

    sound = tone(rate, 25 / 24, channels)
    path = outputs.write_sample(tmp_path, request(0, 25), torch.rand(3, 25, 8, 16) * 2 - 1,
                                24.0, audio=(sound, rate))
    assert outputs.has_sound(path)
    with av.open(str(path)) as container:
        picture, track = container.streams.video[0], container.streams.audio[0]
        assert picture.frames == 25
        assert (track.codec_context.name, track.rate, track.channels) == ("aac", rate, channels)
        assert abs(float(track.duration * track.time_base) - 25 / 24) < 1 / 24
        decoded = np.concatenate([f.to_ndarray() for f in container.decode(track)], axis=1)
    assert decoded.shape[0] == channels
    middle = slice(rate // 10, sound.shape[1] - rate // 10)  # away from the codec's edges
    error = np.abs(decoded[:, middle] - sound[:, middle].numpy()).max()
    assert error < 0.05, error


def test_tensorboard_gets_images_and_clips(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    outputs.add_to_tensorboard(writer, request(0), torch.zeros(3, 8, 16), 24.0, step=3)
    outputs.add_to_tensorboard(writer, request(1, 5), torch.zeros(3, 5, 8, 16), 24.0, step=3,
                               audio=(tone(16000, 5 / 24, 2), 16000))
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "audio": 0})
    events.Reload()
    image, clip = events.Images("samples/0")[0], events.Images("samples/1")[0]
    assert (image.step, image.width, image.height) == (3, 16, 8)
    assert clip.encoded_image_string[:6] == b"GIF89a" and (clip.width, clip.height) == (16, 8)
    sound = events.Audio("samples/1/sound")[0]
    assert (sound.step, sound.sample_rate, sound.length_frames) == (3, 16000, 3333)
    assert events.Tags()["audio"] == ["samples/1/sound"]  # an image has none


def test_the_index_page_has_a_row_per_prompt_and_a_column_per_step(tmp_path):
    for step in (10, 2):
        for r in (request(0), request(1)):
            outputs.write_sample(tmp_path / f"step_{step}", r, torch.zeros(3, 8, 16), 24.0)
        outputs.write_prompts(tmp_path / f"step_{step}", [request(0), request(1)])
    # A resumed run that changed sample.prompts: its prompt 1 is another prompt.
    changed = SampleRequest(1, "a new prompt", "", 1, 16, 8)
    outputs.write_sample(tmp_path / "step_12", changed, torch.zeros(3, 8, 16), 24.0)
    outputs.write_prompts(tmp_path / "step_12", [changed])
    (tmp_path / "sampled-final").mkdir()  # dpipe-sample's: not a training round
    page = outputs.write_index(tmp_path).read_text()
    assert page.index("<th>step_2</th>") < page.index("<th>step_10</th>") < page.index("step_12")
    assert "sampled-final" not in page
    rows = {row.split("</th>")[0].split(">")[-1]: row for row in page.split("<tr>")[2:]}
    assert 'src="step_10/1.png"' in rows["prompt &lt;1&gt; (seed 1, 16x8)"]
    assert "step_12" not in rows["prompt &lt;1&gt; (seed 1, 16x8)"]
    assert 'src="step_12/1.png"' in rows["a new prompt (seed 1, 16x8)"]
    assert "http" not in page  # opens from disk, fetches nothing


def test_the_index_page_plays_the_sound_of_clips_that_have_it(tmp_path):
    folder = tmp_path / "step_5"
    outputs.write_sample(folder, request(0, 5), torch.zeros(3, 5, 8, 16), 24.0,
                         audio=(tone(16000, 5 / 24, 2), 16000))
    outputs.write_sample(folder, request(1, 5), torch.zeros(3, 5, 8, 16), 24.0)
    louder = dataclasses.replace(request(0, 5), audio_guidance=5.0)
    outputs.write_prompts(folder, [louder, request(1, 5)])
    records = json.loads((folder / outputs.PROMPTS_FILE).read_text())
    assert records[0]["audio_guidance"] == 5.0 and "audio_guidance" not in records[1]
    assert [r["label"] for r in records] == ["prompt <0> (seed 1, 16x8x5, audio guidance 5)",
                                             "prompt <1> (seed 1, 16x8x5)"]
    page = outputs.write_index(tmp_path).read_text()
    assert '<video src="step_5/0.mp4" poster="step_5/0.poster.png" controls loop>' in page
    assert '<video src="step_5/1.mp4" poster="step_5/1.poster.png" controls loop muted>' in page


def test_a_clip_shows_its_first_frame_until_it_plays_and_pictures_are_enlarged(tmp_path):
    from PIL import Image

    pixels = -torch.ones(3, 5, 8, 16)
    pixels[:, 0] = 1.0  # a white first frame, then black
    outputs.write_sample(tmp_path / "step_5", request(0, 5), pixels, 24.0)
    outputs.write_prompts(tmp_path / "step_5", [request(0, 5)])
    poster = Image.open(tmp_path / "step_5" / "0.poster.png")
    assert poster.size == (16, 8) and poster.getextrema() == ((255, 255),) * 3
    page = outputs.write_index(tmp_path).read_text()
    assert 'poster="step_5/0.poster.png"' in page
    # A tiny model's 64-pixel samples are drawn 256 pixels wide, each pixel a sharp square.
    assert "width: 256px" in page and "image-rendering: pixelated" in page


def test_a_failing_sample_costs_only_itself():
    from dpipe.models.sampling import Denoising
    from dpipe.sample.denoise import denoise
    from dpipe.sample.link import StageLink

    class Halving:  # x <- x - 0.5 * prediction, the prediction being the input itself
        def inputs(self, d, t, text):
            return (d.latents,)

        def output(self, y):  # `run` hands on the input tuple
            return y[0]

        def prediction(self, output, d):
            return output

        def guide(self, cond, uncond, d):
            return cond

        def step(self, d, t, prediction):
            d.latents = d.latents - 0.5 * prediction

    def states():
        return [Denoising(request(k), torch.ones(1, 2), None, torch.zeros(3), {}, None, 1.0)
                for k in range(2)]

    calls = []

    def run(x):
        calls.append(1)
        if len(calls) == 3:  # the second step's first micro-batch: sample 0
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return x

    link = StageLink.local(torch.device("cpu"))
    failing = states()
    assert denoise(Halving(), failing, link, run, steps=3) == [True, False]
    assert isinstance(link.error, torch.cuda.OutOfMemoryError)
    assert torch.equal(failing[1].latents, torch.full((1, 2), 0.125))
