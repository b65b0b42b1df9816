"""The one-line message for a config group option that does not exist (`model=tiny_wann`).

Hydra's own is a list of every option of the group (52 models), with its search path, and no
hint; this one names the group and the options closest to the spelling.
"""

from __future__ import annotations

import difflib
import re

_MISSING = re.compile(r"In '([^']+)': Could not find '([^']+)/([^'/]+)'")


def unknown_option_message(hydra_message: str) -> str | None:
    """From Hydra's "Could not find 'group/option'" message; None for any other message."""
    found = _MISSING.search(hydra_message)
    if found is None:
        return None
    where, group, option = found.groups()
    listed = re.search(rf"Available options in '{re.escape(group)}':\n((?:\t.*(?:\n|$))*)",
                       hydra_message)
    options = [line.strip() for line in listed.group(1).splitlines()] if listed else []
    options = [o for o in options if o and not o.startswith("base_")]  # the schemas, not options
    close = difflib.get_close_matches(option, options, n=4, cutoff=0.6)
    source = "" if where == "config" else f" (in conf/{where}.yaml)"
    hint = (f"did you mean {close[0]}? (close to it: {', '.join(close)})" if close else
            f"the options are: {', '.join(options)}" if options else
            f"the options are the .yaml files of conf/{group}/")
    return f"{group}={option}{source}: no such option of the {group} group (conf/{group}/); {hint}"
