"""Sweep points' folder names, made from their overrides (Hydra's `override_dirname`).

The launcher leaves only the swept keys in `override_dirname` (`exclude_fixed_keys`): the keys
every point shares are in the sweep's multirun.yaml and its summary's heading. `sweep_dirname`
shortens each key to its shortest dotted suffix that no other key of the name ends with
(`model.lora.rank=16,optim.lr=0.0001` -> `rank=16,lr=0.0001`), replaces slashes (paths), and
cuts a name over MAX_NAME bytes, ending it with a hash of the whole so that two points never
share a folder (the point's number before it, `<num>_`, tells them apart as well).
"""

from __future__ import annotations

import hashlib
import re

MAX_NAME = 120
# Where one `key=value` of an override_dirname ends: a comma before the next `key=` (a value may
# hold commas itself: a list, a prompt).
_NEXT_ITEM = re.compile(r",(?=[\w.@/~+-]+=)")


def sweep_dirname(overrides: str) -> str:
    name = _short_keys(overrides).replace("/", "_")
    if len(name.encode()) <= MAX_NAME:
        return name
    digest = hashlib.sha256(overrides.encode()).hexdigest()[:12]
    return name.encode()[:MAX_NAME - 13].decode(errors="ignore") + "-" + digest


def _short_keys(overrides: str) -> str:
    items = [item.partition("=") for item in _NEXT_ITEM.split(overrides) if item]
    keys = [key for key, _, _ in items]
    short = [_shortest_unique_suffix(key, keys) for key in keys]
    return ",".join(f"{s}{sep}{value}" for s, (_, sep, value) in zip(short, items))


def _shortest_unique_suffix(key: str, keys: list[str]) -> str:
    parts = key.split(".")
    for n in range(1, len(parts) + 1):
        suffix = ".".join(parts[-n:])
        if not any(other != key and (other == suffix or other.endswith("." + suffix))
                   for other in keys):
            return suffix
    return key


def exclude_fixed_keys(task_overrides: list[str], excluded: list[str]) -> list[str] | None:
    """The keys to leave out of the points' folder names: `excluded` and every override that is
    not swept (the same in every point). None when nothing is swept (a one-point sweep, e.g. a
    SLURM submission): then its folder names every override, as Hydra's would."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
    if not swept:
        return None
    # (a key given twice, fixed and then swept, is swept: the last one counts)
    fixed = [o.key_or_group for o in parsed if o.key_or_group not in swept]
    return list(dict.fromkeys([*excluded, *fixed]))


def register_resolver() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("dpipe_dirname"):
        OmegaConf.register_new_resolver("dpipe_dirname", sweep_dirname)
