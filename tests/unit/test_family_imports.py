"""A family folder imports only the shared layer and its own files (docs/adding-a-model.md).

Every `dpipe/models/<family>/*.py` is parsed (function-level imports included). An import of
another family's folder fails, unless it is a declared variant's import of its base's public
names (ALLOWED below). A name with a leading underscore never crosses a folder. `dpipe/models/common/`
imports no family at all: a helper a second family needs moves there, it is not imported from
its first owner.
"""

from __future__ import annotations

import ast
from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "dpipe" / "models"
SHARED = "common"

# (variant, base): the base's public names the variant is built on. A variant runs its base's
# denoiser blocks or spec with a different pipeline or conditioning; it reuses the base's public
# API instead of copying it. Generic helpers never belong here: they go to dpipe/models/common/.
ALLOWED = {
    # FLUX.1 Kontext: FluxSpec with reference-image tokens; FLUX.1's tiny model plus a reference.
    ("flux_kontext", "flux"): {"FluxSpec", "REQUIRED_PARTS", "FluxSampling", "write_tiny_flux"},
    # LTX-2: LTX-Video's spec and head, with an audio stream and Gemma text.
    ("ltx2", "ltx_video"): {"LTXVideoSpec", "ENCODING_VERSION", "LTXHead", "frame_rate",
                            "text_bias", "unpack"},
    # LTX-2.3: LTX-2's spec, layers, tiny model and audio prompt key with the 2.3 release's
    # switches on.
    ("ltx23", "ltx2"): {"LTX2Spec", "LTX2VideoBlock", "LTX2AVBlock", "TRANSFORMER", "VAE",
                        "make_tiny_ltx2", "AUDIO_TEXT_KEY"},
    # HunyuanVideo 1.5: HunyuanVideo's sampling, rotary embedding call and unpatchify.
    ("hunyuan_video15", "hunyuan_video"): {"HunyuanVideoSampling", "rotary", "unpatchify"},
}


def _families() -> set[str]:
    return {p.name for p in MODELS.iterdir()
            if p.is_dir() and p.name != SHARED and any(p.glob("*.py"))}


def _imports(file: Path):
    """(line, imported dpipe.models folder, names) of every import in `file`."""
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            if parts[:2] == ["dpipe", "models"]:
                if len(parts) > 2:
                    yield node.lineno, parts[2], names
                else:  # from dpipe.models import <folder or module>
                    for name in names:
                        yield node.lineno, name, ["*"]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["dpipe", "models"] and len(parts) > 2:
                    yield node.lineno, parts[2], ["*"]


def _violations() -> list[str]:
    families = _families()
    out = []
    for folder in sorted(families | {SHARED}):
        for file in sorted((MODELS / folder).glob("*.py")):
            where = file.relative_to(MODELS.parents[1])
            for line, target, names in _imports(file):
                if target == folder or target not in families:
                    continue  # its own folder, or a shared module
                allowed = ALLOWED.get((folder, target), set())
                bad = [n for n in names if n not in allowed or n.startswith("_")]
                if bad:
                    out.append(f"{where}:{line}: imports {', '.join(bad)} from {target}/")
    return out


def test_no_family_imports_another_familys_folder():
    violations = _violations()
    assert not violations, (
        "a family folder may import only dpipe/models/common/, the top-level shared modules and "
        "its own files (docs/adding-a-model.md); move what two families share to "
        "dpipe/models/common/:\n" + "\n".join(violations))


def test_the_checker_sees_folders_and_function_level_imports(tmp_path):
    # The walk covers imports inside functions (tiny.py files import lazily) and
    # `from dpipe.models import <family>`.
    file = tmp_path / "x.py"
    file.write_text("def f():\n    from dpipe.models.flux.spec import _pack\n"
                    "from dpipe.models import wan\nimport dpipe.models.sdxl.layers\n")
    assert sorted(t for _, t, _ in _imports(file)) == ["flux", "sdxl", "wan"]


def test_the_allow_list_names_existing_public_names():
    # A stale entry would silently widen the rule.
    families = _families()
    for (variant, base), names in ALLOWED.items():
        assert {variant, base} <= families
        for name in names:
            assert not name.startswith("_")
            sources = " ".join(f.read_text() for f in (MODELS / base).glob("*.py"))
            assert f"def {name}" in sources or f"class {name}" in sources or \
                f"{name} =" in sources, f"{base}/ has no {name}"
