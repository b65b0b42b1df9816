"""Captions: same-stem .txt files or a JSON/JSONL captions file; prefix and tag shuffling. A
captions file's records may also name each file's control images (`"control": "a.png"` or
`["a.png", "b.png"]`, in order, paths inside the directory's control_dir).

Every variant a sample can be trained with is a fixed string known before training (the captions
of its file, each shuffled into `tag_variants` orders), so each is encoded once into the cache
and training only picks one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import NamedTuple

from dpipe.errors import DataError

_FILE_KEYS = ("file", "path", "image", "video", "name")
_CAPTION_KEYS = ("captions", "caption", "text", "prompt")
_CONTROL_KEY = "control"


class CaptionsFile(NamedTuple):
    captions: dict[str, list[str]]  # file name -> its captions
    controls: dict[str, list[str]]  # file name -> its control images, where a record names them


def read_caption(path: Path) -> str:
    try:
        # utf-8-sig: drops the byte-order mark some Windows editors write.
        return path.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError as error:
        raise DataError(f"caption {path} is not UTF-8 text ({error}): save it as UTF-8.")
    except OSError as error:
        raise DataError(f"cannot read caption {path} ({error}): check its permissions.")


def load_captions_file(path: Path) -> CaptionsFile:
    """File name (as written in the file: a path relative to the directory, or a bare name) ->
    its captions (and control images). JSON: {"cat.jpg": "a cat"} or {"cat.jpg": ["a cat", "a
    tabby"]} or a list of records; JSONL: one record per line, e.g. {"file": "cat.jpg",
    "caption": "a cat"}, or with {"control": ["cat_ref.png", "hat.png"]}."""
    if not path.is_file():
        raise DataError(f"captions_file {path} does not exist: fix the dataset's captions_file.")
    try:
        text = path.read_text(encoding="utf-8-sig")
        if path.suffix.lower() == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text)
            records = data if isinstance(data, list) else None
            if isinstance(data, dict):
                return CaptionsFile({str(k): _caption_list(v, path, k) for k, v in data.items()},
                                    {})
    except (ValueError, OSError) as error:
        raise DataError(f"cannot read captions_file {path} ({error}): it must be JSON or JSONL.")
    if records is None:
        raise DataError(f"captions_file {path}: expected an object or a list of records.")
    out: dict[str, list[str]] = {}
    controls: dict[str, list[str]] = {}
    for number, record in enumerate(records, 1):
        name = next((record.get(k) for k in _FILE_KEYS if isinstance(record, dict) and k in record),
                    None)
        value = next((record[k] for k in _CAPTION_KEYS if isinstance(record, dict) and k in record),
                     None)
        if name is None or value is None:
            raise DataError(
                f"captions_file {path}, record {number}: needs a file name (one of "
                f"{', '.join(_FILE_KEYS)}) and captions (one of {', '.join(_CAPTION_KEYS)}); "
                f"got {record!r}")
        out.setdefault(str(name), []).extend(_caption_list(value, path, name))
        if _CONTROL_KEY in record:
            controls[str(name)] = _control_list(record[_CONTROL_KEY], path, name, number)
    return CaptionsFile(out, controls)


def match_captions(table: dict[str, list[str]], rel: str) -> list[str] | None:
    """Captions for the file at `rel` (relative path), matched by relative path, then by name."""
    if rel in table:
        return table[rel]
    return table.get(rel.rsplit("/", 1)[-1])


def caption_variants(captions: list[str], prefix: str, shuffle: bool, variants: int,
                     keep: int, separator: str) -> list[str]:
    """The distinct strings a sample is trained with, in a fixed order."""
    if not shuffle and len(captions) == 1:
        return [prefix + captions[0]]
    out: list[str] = []
    for caption in captions:
        if not shuffle:
            candidates = [caption]
        else:
            tags = [t.strip() for t in caption.split(separator) if t.strip()]
            fixed, rest = tags[:keep], tags[keep:]
            joiner = separator.strip() + " "
            # Seeded by the caption itself: the same caption always gives the same variants,
            # whichever process, run or file order computes them.
            rng = random.Random(f"dpipe-tags:{caption}")
            candidates = []
            for _ in range(variants):
                shuffled = rest[:]
                rng.shuffle(shuffled)
                candidates.append(joiner.join(fixed + shuffled))
        for c in candidates:
            text = prefix + c
            if text not in out:
                out.append(text)
    return out


def _caption_list(value, path: Path, name) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise DataError(f"captions_file {path}: the captions of {name!r} must be a string or a "
                        f"non-empty list of strings, got {value!r}")
    return [v.strip() for v in values]


def _control_list(value, path: Path, name, number: int) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise DataError(f"captions_file {path}, record {number}: the control of {name!r} must be "
                        f"an image path or a non-empty list of them (inside control_dir), got "
                        f"{value!r}")
    return [v.strip() for v in values]
