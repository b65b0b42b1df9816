"""Sweep points' folder names, made from their overrides (Hydra's `override_dirname`).

A point's overrides can hold slashes (paths) and run long (`sample.prompts=[...]`); a folder
name may hold neither a slash nor more than 255 bytes. `sweep_dirname` keeps a short name as it
is, with slashes replaced, and cuts a long one, ending it with a hash of the whole so that two
points never share a folder.
"""

from __future__ import annotations

import hashlib

MAX_NAME = 120


def sweep_dirname(overrides: str) -> str:
    name = overrides.replace("/", "_")
    if len(name.encode()) <= MAX_NAME:
        return name
    digest = hashlib.sha256(overrides.encode()).hexdigest()[:12]
    return name.encode()[:MAX_NAME - 13].decode(errors="ignore") + "-" + digest


def register_resolver() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("dpipe_dirname"):
        OmegaConf.register_new_resolver("dpipe_dirname", sweep_dirname)
