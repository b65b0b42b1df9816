"""The default run name (`name`, which names the run dir `outputs/<name>`): `<model>-<dataset>`.

A folder dataset is named by its folder (`tiny_wan-clips` for dataset.path=/data/clips), any
other by its dataset option (`tiny_flux-synthetic`, `flux-photos_and_clips`), so that another
folder starts another run where the same command resumes. Where the plain name's run dir already
trained on other folders (two folders of one name: /data/a/photos, /data/b/photos), the name
ends with a short hash of the folders' paths (`flux-photos-3fa2c1`): each folder keeps one run
dir, found again the next time. An explicit `name=` is taken as it is (a resume on other folders
is then refused, dpipe.train.checkpoint).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

OUTPUTS = Path("outputs")  # conf/config.yaml: hydra.run.dir is outputs/${name}
RUN_CONFIG = "run.yaml"  # the run config a run dir keeps (dpipe.launch.run_rank)


def dataset_folders(config_yaml: str) -> list[str]:
    """The folders a run config trains on: `dataset.path`, then each `dataset.directories` path."""
    dataset = OmegaConf.to_container(OmegaConf.create(config_yaml)).get("dataset") or {}
    folders = [dataset["path"]] if dataset.get("path") else []
    return folders + [entry.get("path") for entry in dataset.get("directories") or []]


def same_folders(old: list[str], new: list[str]) -> bool:
    return len(old) == len(new) and all(_same_folder(a, b) for a, b in zip(old, new))


def _same_folder(a: str, b: str) -> bool:
    a, b = os.path.expanduser(a), os.path.expanduser(b)
    if os.path.normpath(a) == os.path.normpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # another spelling (a link, a relative path) of one folder
    except OSError:
        return False


def default_run_name(model: str, dataset_option: str, *, _root_: DictConfig) -> str:
    """conf/config.yaml's `name` (resolver `dpipe_run_name`), from the model and dataset options
    Hydra picked and the composed dataset config."""
    dataset = _root_.dataset
    if dataset.kind != "folder":  # generated data (the demo): its option names it
        return f"{model}-{dataset_option}"
    path = None if OmegaConf.is_missing(dataset, "path") else dataset.path
    folders = [path] if path else []
    folders += [entry.path for entry in dataset.get("directories") or []
                if not OmegaConf.is_missing(entry, "path") and entry.path]
    label = Path(os.path.abspath(os.path.expanduser(path))).name if path else dataset_option
    plain = f"{model}-{label}"
    if not folders:  # dataset.path not given yet: the config checks say so
        return plain
    spelt = "\n".join(os.path.abspath(os.path.expanduser(f)) for f in folders)
    hashed = f"{plain}-{hashlib.sha256(spelt.encode()).hexdigest()[:6]}"
    if (OUTPUTS / hashed).is_dir():
        return hashed
    try:
        trained_on = dataset_folders((OUTPUTS / plain / RUN_CONFIG).read_text())
    except (OSError, ValueError):  # no run there yet (or one that never got to save its config)
        return plain
    return plain if same_folders(trained_on, folders) else hashed


def register_resolver() -> None:
    if not OmegaConf.has_resolver("dpipe_run_name"):
        OmegaConf.register_new_resolver("dpipe_run_name", default_run_name)
