"""The house runs one way: every `dpipe` import (at module or function level, relative ones too)
goes to its own unit or to a unit of a lower layer, never up or sideways.

The layer table below is the architecture that README.md's "How it fits together" draws, in
one place. A unit is a package (`dpipe.train`), a top-level module (`dpipe.io`), one model
family's folder (`dpipe/models/<family>/`: families never import one another), or the shared
model layer (`dpipe/models/*.py` and `dpipe/models/common/`). No exceptions: what two units of
one layer share moves down. A name with a leading underscore never leaves its unit.
"""

from __future__ import annotations

import ast
from pathlib import Path

DPIPE = Path(__file__).resolve().parents[2] / "dpipe"
FAMILY = "dpipe.models.<family>"

# Top to bottom: a unit imports units of the layers below its own.
LAYERS = [
    ["dpipe.cli"],
    ["dpipe.bench"],  # runs training's workers and measures them
    ["dpipe.launch"],  # the launcher, its workers, sweeps, pre-start checks
    ["dpipe.plan"],  # what a run needs of the machine, before it starts: the layout that fits
    ["dpipe.train"],
    ["dpipe.sample"],  # training samples as it goes
    ["dpipe.pipeline", "dpipe.data"],  # the engine and its stages; the cache and the loader
    [FAMILY],
    ["dpipe.models"],  # the model interface and what families share
    ["dpipe.diffusion", "dpipe.images"],  # the objective; image files as data reads them
    ["dpipe.config"],
    ["dpipe.io"],
    ["dpipe.errors"],
]
LAYER_OF = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """The unit of a dotted module name under dpipe."""
    parts = module.split(".")
    if parts[:2] == ["dpipe", "models"] and len(parts) > 2 and parts[2] != "common" \
            and (DPIPE / "models" / parts[2]).is_dir():
        return f"dpipe.models.{parts[2]}"
    return ".".join(parts[:2])


def layer_of(unit: str) -> int:
    return LAYER_OF[FAMILY if unit.count(".") == 2 else unit]


def module_name(file: Path) -> str:
    parts = list(file.relative_to(DPIPE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(file: Path):
    """(line, dotted dpipe module, names imported from it) of every import in `file`, relative
    ones resolved."""
    name = module_name(file)
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "dpipe.models" or target == "dpipe":  # from dpipe(.models) import x
                for alias in node.names:
                    yield node.lineno, f"{target}.{alias.name}", []
            elif target.startswith("dpipe."):
                yield node.lineno, target, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dpipe."):
                    yield node.lineno, alias.name, []


def violations() -> list[str]:
    out = []
    for file in sorted(DPIPE.rglob("*.py")):
        source = module_name(file)
        if source == "dpipe":
            continue  # the package's own __init__ imports nothing below
        mine = unit_of(source)
        for line, target, names in imports(file):
            theirs = unit_of(target)
            if theirs == mine:
                continue
            where = f"{file.relative_to(DPIPE.parent)}:{line}: {mine} imports {target}"
            if layer_of(theirs) <= layer_of(mine):
                out.append(f"{where} ({'up' if layer_of(theirs) < layer_of(mine) else 'sideways'})")
            private = [n for n in names if n.startswith("_")]
            if private:  # a unit's private names are its own
                out.append(f"{where}: its private {', '.join(private)}")
    return out


def test_every_import_goes_down_the_layers():
    found = violations()
    assert not found, ("imports against the layers (tests/unit/test_layers.py LAYERS; move "
                       "what two units share down to a layer both may import, and make it "
                       "public there):\n"
                       + "\n".join(found))


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(f)) for f in DPIPE.rglob("*.py")} - {"dpipe"}
    assert all(u.count(".") == 2 or u in LAYER_OF for u in units), sorted(units - set(LAYER_OF))


def test_the_walk_sees_relative_function_level_and_package_imports(tmp_path):
    folder = DPIPE / "models" / "flux"
    file = folder / "x_probe.py"
    assert not file.exists()
    file.write_text("def f():\n    from .layers import FluxBlock\n"
                    "from dpipe.models import wan\nimport dpipe.train.loop\n"
                    "from ..common import stage_io\n")
    try:
        found = sorted(t for _, t, _ in imports(file))
    finally:
        file.unlink()
    assert found == ["dpipe.models.common", "dpipe.models.flux.layers", "dpipe.models.wan",
                     "dpipe.train.loop"]
    assert [unit_of(t) for t in found] == ["dpipe.models", "dpipe.models.flux",
                                           "dpipe.models.wan", "dpipe.train"]


def test_every_folder_of_code_is_a_package():
    # pyproject's packages.find (setuptools' find_packages) leaves out a folder without an
    # __init__.py: a non-editable install would lack its modules (LTX-Video's and HunyuanVideo's
    # folders lacked one until 2026-12-07).
    folders = {f.parent for f in DPIPE.rglob("*.py")}
    assert not sorted(str(d) for d in folders if not (d / "__init__.py").is_file())
