"""`sample.prompts` -> requests, and every mistake in them named before anything runs."""

from __future__ import annotations

import pytest

from dpipe.config.schema import DatasetConfig, ModelConfig, SampleConfig
from dpipe.errors import ConfigError
from dpipe.models.registry import build_spec
from dpipe.sample.requests import sample_requests


@pytest.fixture(scope="module")
def flux(dpipe_cache):
    spec = build_spec(ModelConfig(family="flux", path=str(dpipe_cache / "models" / "tiny-flux"),
                                  tiny=True))
    spec.ensure_available()
    return spec


def test_items_take_the_defaults_and_their_own_keys(flux):
    cfg = SampleConfig(prompts=["a cat", {"prompt": "a dog", "seed": 3, "width": 48}],
                       seed=11, negative_prompt="blurry", height=32)
    dataset = DatasetConfig(path="/data", resolutions=[64, 128])
    first, second = sample_requests(cfg, flux, dataset)
    assert (first.prompt, first.seed, first.width, first.height) == ("a cat", 11, 128, 32)
    assert (second.prompt, second.seed, second.width, second.height) == ("a dog", 3, 48, 32)
    assert first.negative_prompt == second.negative_prompt == "blurry"
    assert (first.index, second.index, first.frames) == (0, 1, 1)
    assert first.audio_guidance is second.audio_guidance is None


def test_no_prompts_no_requests(flux):
    assert sample_requests(SampleConfig(), flux) == []


def test_a_prompts_file_gives_one_prompt_per_line_after_the_items(flux, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("# the trigger word first\nsks style, a red ball\n\n  a blue cube  \n")
    cfg = SampleConfig(prompts=[{"prompt": "a cat", "seed": 3}], prompts_file=str(path))
    requests = sample_requests(cfg, flux)
    assert [(r.index, r.prompt) for r in requests] == [
        (0, "a cat"), (1, "sks style, a red ball"), (2, "a blue cube")]
    assert sample_requests(SampleConfig(prompts_file=str(path)), flux)[0].prompt == (
        "sks style, a red ball")


@pytest.mark.parametrize("text, message", [
    (None, "sample.prompts_file={path}: no such file; give a text file with one prompt per line"),
    ("# only a comment\n\n", "sample.prompts_file={path} holds no prompt: write one per line"),
])
def test_a_missing_or_empty_prompts_file_is_named(flux, tmp_path, text, message):
    path = tmp_path / "prompts.txt"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as error:
        sample_requests(SampleConfig(prompts_file=str(path)), flux)
    assert message.format(path=path) in str(error.value)


def test_the_default_size_is_a_multiple_of_the_familys(flux):
    (request,) = sample_requests(SampleConfig(prompts=["x"]), flux,
                                 DatasetConfig(path="/d", resolutions=[100]))
    assert (request.width, request.height) == (96, 96)


@pytest.mark.parametrize("item, message", [
    ({"prompt": "a", "steps": 3}, "sample.prompts[0] has unknown key(s) steps"),
    ({"seed": 3}, "sample.prompts[0] has no `prompt`"),
    (3, "give a prompt (a string) or a mapping"),
    ({"prompt": "a", "width": 20}, "sample.prompts[0].width=20 (or sample.width): flux needs sizes "
                                   "that are multiples of 8; use 16 or 24"),
    ({"prompt": "a", "seed": -1}, "sample.prompts[0].seed=-1: must be a whole number >= 0"),
    ({"prompt": "a", "frames": 5}, "frames=5: flux makes images"),
    ({"prompt": "a", "control": "/no/such/image.png"}, "sample.prompts[0].control=/no/such/"),
    ({"prompt": 7}, "sample.prompts[0].prompt=7: must be a string"),
    ({"prompt": "a", "audio_guidance": 0}, "sample.prompts[0].audio_guidance=0 (or "
                                           "sample.audio_guidance): must be a number > 0"),
    ({"prompt": "a", "audio_guidance": 5}, "sample.prompts[0]: audio_guidance=5.0 (or "
                                           "sample.audio_guidance): flux makes no sound here"),
])
def test_a_bad_item_is_named_with_what_to_change(flux, item, message):
    with pytest.raises(ConfigError) as error:
        sample_requests(SampleConfig(prompts=[item]), flux)
    assert message in str(error.value)


def test_a_control_image_is_refused_by_a_family_that_takes_none(flux, tmp_path):
    image = tmp_path / "c.png"
    image.write_bytes(b"")
    with pytest.raises(ConfigError, match="flux takes no control image; remove `control`"):
        sample_requests(SampleConfig(prompts=[{"prompt": "a", "control": str(image)}]), flux)


@pytest.mark.parametrize("key, value, message", [
    ("every_steps", -1, "sample.every_steps=-1: must be >= 0"),
    ("steps", 0, "sample.steps=0: must be >= 1"),
])
def test_bad_round_settings(flux, key, value, message):
    with pytest.raises(ConfigError, match=message):
        sample_requests(SampleConfig(prompts=["a"], **{key: value}), flux)


def test_first_and_last_frames_are_checked_against_the_checkpoint(flux, tmp_path):
    from tests.unit.test_frame_conditioning import _wan

    start, end = tmp_path / "start.png", tmp_path / "end.png"
    start.write_bytes(b"")
    end.write_bytes(b"")
    item = {"prompt": "a", "first_frame": str(start), "last_frame": str(end), "frames": 5}
    size = {"width": 64, "height": 64}
    [request] = sample_requests(SampleConfig(prompts=[item], **size), _wan("i2v_a14b"))
    assert (request.control, request.last_frame) == (str(start), str(end))
    for spec, changes, message in [
        (flux, {"first_frame": None, "frames": 1},
         r"last_frame=.*end.png: model.family=flux at .* takes no last frame"),
        (_wan("i2v"), {}, r"takes no last frame \(its frame modes: first\)"),
        (_wan("i2v_a14b"), {"frames": 1}, "a one-frame sample has no last frame"),
        (_wan("i2v_a14b"), {"control": str(start)}, "gives both `control` and `first_frame`"),
        (_wan("i2v_a14b"), {"last_frame": str(tmp_path / "gone.png")},
         r"last_frame=.*gone.png: no such image file"),
        (_wan("flf2v"), {"last_frame": None}, "FLF2V samples from a first and a last frame"),
    ]:
        prompts = [{k: v for k, v in {**item, **changes}.items() if v is not None}]
        with pytest.raises(ConfigError, match=message):
            sample_requests(SampleConfig(prompts=prompts, **size), spec)
