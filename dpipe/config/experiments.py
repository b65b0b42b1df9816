"""Experiment presets: `conf/experiment/<name>.yaml`, chosen with `experiment=<name>`.

A preset is a delta on the defaults (`# @package _global_`) that sets keys of several groups at
once, e.g. a model with the memory settings that fit one GPU size. conf/config.yaml declares the
group with `experiment: null`, so Hydra takes `experiment=<name>`; the `+experiment=<name>` that
Hydra's docs show for an undeclared group would fail there ("Multiple values for experiment"),
so `preset_overrides` turns it into `experiment=<name>`. It also refuses a name that is not a
file of conf/experiment/ with the list of those that are, before Hydra composes anything.
"""

from __future__ import annotations

import re
from pathlib import Path

from dpipe.errors import ConfigError

GROUP = "experiment"
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
_OVERRIDE = re.compile(rf"^\+{{0,2}}{GROUP}=(.*)$")
_NAMES = re.compile(r"^[\w.-]+(,[\w.-]+)*$")  # a name, or a sweep's plain list a,b


def presets(conf_dir: Path = CONF_DIR) -> list[str]:
    """The preset names: the .yaml files of conf/experiment/."""
    return sorted(p.stem for p in (conf_dir / GROUP).glob("*.yaml"))


def preset_overrides(args: list[str], conf_dir: Path = CONF_DIR) -> list[str]:
    """`args` with `+experiment=X` (or `++`) as `experiment=X`, after checking that each X
    named is a preset. Other arguments (flags, other overrides) pass through unchanged; a sweep
    expression other than a plain list (`choice(...)`, `glob(...)`) is left to Hydra."""
    out = []
    for arg in args:
        match = _OVERRIDE.match(arg)
        if match is None:
            out.append(arg)
            continue
        value = match.group(1)
        if _NAMES.match(value):
            known = presets(conf_dir)
            unknown = [name for name in value.split(",") if name not in known]
            if unknown:
                raise ConfigError(
                    f"{GROUP}={','.join(unknown)}: no such preset in conf/{GROUP}/; the presets "
                    f"are: {', '.join(known) or 'none'} (files of conf/{GROUP}/: e.g. "
                    f"{GROUP}={known[0] if known else '...'})")
        out.append(f"{GROUP}={value}")
    return out


def preset_keys(name: str, conf_dir: Path = CONF_DIR) -> set[str]:
    """The dotted keys preset `name` sets (a group it overrides, e.g. `/pipeline`, as that
    group's `stages`, but for `/pipeline: auto`, which leaves them to the plan): what a plan
    keeps as the preset chose it."""
    import yaml

    body = yaml.safe_load((conf_dir / GROUP / f"{name}.yaml").read_text()) or {}
    keys = set()
    for entry in body.pop("defaults", []):
        if isinstance(entry, dict):
            keys |= {f"{k.split('/')[-1]}.stages" for k, v in entry.items()
                     if k.endswith("/pipeline") and v != "auto"}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            keys.add(prefix[:-1])

    walk("", body)
    return keys
