"""`sample.prompts` -> the samples to make, each checked against the model family.

Called before any worker starts (dpipe-train and dpipe-sample), so a bad item stops the run with
one message naming the item, the key and what to change.
"""

from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from dpipe.config.schema import PROMPT_KEYS, DatasetConfig, SampleConfig
from dpipe.errors import ConfigError
from dpipe.models.sampling import SampleRequest


def sample_requests(cfg: SampleConfig, spec, dataset: DatasetConfig | None = None
                    ) -> list[SampleRequest]:
    """The requests of `cfg.prompts` then `cfg.prompts_file`, in order; [] without prompts
    (nothing is loaded then)."""
    items = list(cfg.prompts) + prompts_from_file(cfg.prompts_file)
    if not items:
        return []
    if cfg.every_steps < 0:
        raise ConfigError(f"sample.every_steps={cfg.every_steps}: must be >= 0 (0: only at the end)")
    if cfg.steps is not None and cfg.steps < 1:
        raise ConfigError(f"sample.steps={cfg.steps}: must be >= 1, or null for the family's usual")
    sampling = spec.sampling()
    if cfg.guidance is not None and sampling.guidance_kind == "distilled":
        raise ConfigError(f"sample.guidance={cfg.guidance}: {spec.family} samples without "
                          "guidance (its release is guidance-distilled); leave sample.guidance "
                          "unset")
    multiple = spec.pixel_multiple
    side = _default_side(dataset, multiple)
    # frame_buckets: null (chosen from the clips by the workers) samples images unless told.
    buckets = dataset.frame_buckets if dataset is not None and sampling.video else None
    frames = cfg.frames or (max(buckets) if buckets else 1)
    # The longest bucket may not fit the family's frame counts: the default is cut to the one
    # below. A sample.frames the user gave is checked as given (MiniMax H3's 124 is one of its
    # 17k+5, not a 4k+1 to round down to 121).
    if not cfg.frames and sampling.video and (frames - 1) % sampling.frame_step:
        frames = (frames - 1) // sampling.frame_step * sampling.frame_step + 1
    requests = []
    for index, item in enumerate(items):
        where = (f"sample.prompts[{index}]" if index < len(cfg.prompts) else
                 f"sample.prompts_file={cfg.prompts_file}, prompt {index - len(cfg.prompts) + 1}")
        fields = _fields(item, where)
        request = SampleRequest(
            index=index,
            prompt=_text(fields, "prompt", where, None),
            negative_prompt=_text(fields, "negative_prompt", where, cfg.negative_prompt),
            seed=_whole(fields, "seed", where, cfg.seed, 0),
            width=_whole(fields, "width", where, cfg.width or side, 1),
            height=_whole(fields, "height", where, cfg.height or side, 1),
            frames=_whole(fields, "frames", where, frames, 1),
            control=_first_frame(fields, where),
            last_frame=_image(fields, "last_frame", where, "the clip's last frame"),
            audio_guidance=_scale(fields, "audio_guidance", where, cfg.audio_guidance),
        )
        for key in ("width", "height"):
            value = getattr(request, key)
            if value % multiple:
                raise ConfigError(
                    f"{where}.{key}={value} (or sample.{key}): {spec.family} needs sizes that are "
                    f"multiples of {multiple}; use {value // multiple * multiple or multiple} or "
                    f"{(value // multiple + 1) * multiple}")
        problem = sampling.check(request)
        if problem:
            raise ConfigError(f"{where}: {problem}")
        requests.append(request)
    return requests


def prompts_from_file(path: str | None) -> list[str]:
    """The prompts of a `sample.prompts_file`: one per line, blank and # lines skipped."""
    if path is None:
        return []
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"sample.prompts_file={path}: no such file; give a text file with one "
                          "prompt per line") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"sample.prompts_file={path}: cannot be read as UTF-8 text ({err})"
                          ) from None
    prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise ConfigError(f"sample.prompts_file={path} holds no prompt: write one per line "
                          "(lines starting with # are skipped)")
    return prompts


def _default_side(dataset: DatasetConfig | None, multiple: int) -> int:
    side = max(dataset.resolutions) if dataset is not None else 1024
    return max(multiple, side // multiple * multiple)


def _fields(item, where: str) -> dict:
    if isinstance(item, (DictConfig, ListConfig)):
        item = OmegaConf.to_container(item, resolve=True)
    if isinstance(item, str):
        return {"prompt": item}
    if not isinstance(item, dict):
        raise ConfigError(f"{where}={item!r}: give a prompt (a string) or a mapping with `prompt`")
    unknown = sorted(set(item) - set(PROMPT_KEYS))
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}; an item may set: "
                          f"{', '.join(PROMPT_KEYS)}")
    if "prompt" not in item:
        raise ConfigError(f"{where} has no `prompt`: every item needs one")
    return item


def _text(fields: dict, key: str, where: str, default: str | None) -> str:
    value = fields.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{key}={value!r}: must be a string")
    return value


def _whole(fields: dict, key: str, where: str, default: int, least: int) -> int:
    value = fields.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{where}.{key}={value!r}: must be a whole number >= {least}")
    return value


def _scale(fields: dict, key: str, where: str, default: float | None) -> float | None:
    value = fields.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"{where}.{key}={value!r} (or sample.{key}): must be a number > 0, "
                          "or null for the family's usual value")
    return float(value)


def _first_frame(fields: dict, where: str) -> str | tuple[str, ...] | None:
    """`first_frame` is the control image of image-to-video families, by the name of its role."""
    if fields.get("first_frame") is not None and fields.get("control") is not None:
        raise ConfigError(f"{where} gives both `control` and `first_frame`, which are one image "
                          "for image-to-video: keep one")
    if fields.get("first_frame") is not None:
        return _image(fields, "first_frame", where, "the clip's first frame")
    return _control(fields, where)


def _image(fields: dict, key: str, where: str, what: str) -> str | None:
    value = fields.get(key)
    if value is None:
        return None
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ConfigError(f"{where}.{key}={value}: no such image file; give the path of {what}")
    return str(path.resolve())


def _control(fields: dict, where: str) -> str | tuple[str, ...] | None:
    """An image path, or a list of them (several references, in order): one stays a string."""
    value = fields.get("control")
    if value is None:
        return None
    values = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    if not values:
        raise ConfigError(f"{where}.control=[]: give an image path (or several), or leave "
                          "`control` out")
    paths = []
    for number, one in enumerate(values):
        path = Path(str(one)).expanduser()
        if not path.is_file():
            key = f"{where}.control" + (f"[{number}]" if len(values) > 1 else "")
            raise ConfigError(f"{key}={one}: no such image file; give the path of the "
                              "control image to edit or animate")
        paths.append(str(path.resolve()))
    return paths[0] if len(paths) == 1 else tuple(paths)
