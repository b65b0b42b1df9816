"""A tiny random FLUX.1 Kontext [dev], in the diffusers layout of
black-forest-labs/FLUX.1-Kontext-dev.

That repo has exactly FLUX.1-dev's layout and architecture (the same component classes, scheduler
and VAE; a FluxTransformer2DModel with guidance embedding); only model_index.json names the
FluxKontextPipeline. So this writes the tiny FLUX.1-dev of `dpipe.models.flux.tiny` and names the
Kontext pipeline in its model_index.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from dpipe.models.tiny_parts import write_atomically


def make_tiny_flux_kontext(path: Path, seed: int = 0) -> Path:
    """Write (once) a tiny random FLUX.1-Kontext-dev diffusers folder at `path` and return it (an
    existing complete folder is left untouched; concurrent callers are safe)."""
    path = Path(path)
    if not (path / "model_index.json").is_file():
        if path.is_dir() and any(path.iterdir()):
            raise FileExistsError(
                f"{path} exists but has no model_index.json, so it is not a tiny model written by"
                " make_tiny_flux_kontext; delete it or choose another folder")
        write_atomically(path, lambda tmp: _write(tmp, seed))
    return path


def _write(out: Path, seed: int) -> None:
    from dpipe.models.flux.tiny import write_tiny_flux

    write_tiny_flux(out, seed)
    index = json.loads((out / "model_index.json").read_text())
    index["_class_name"] = "FluxKontextPipeline"
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
