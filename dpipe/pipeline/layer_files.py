"""A checkpoint's per-layer weight files: each pipeline layer's tensors as safetensors (a pickle in
checkpoints of dpipe before 2026-12-05), named so that a stage finds its layers' files, and
checked against the layer before they load. The pipeline module writes and reads them; the
trainer's checkpoints (dpipe.train.checkpoint) hold them with DeepSpeed's own files.
"""

from __future__ import annotations

from pathlib import Path

from dpipe.errors import UserError
from dpipe.pipeline.checkpoint_pickles import load_pickle


class CheckpointError(UserError):
    """No checkpoint in the run dir can be loaded (each is damaged)."""


# A layer file's metadata key: {tensor name in the file: its name in the diffusers model}.
EXPORT_NAMES = "dpipe_export_names"


def layer_file(checkpoint_dir, index: int) -> Path:
    """The safetensors file of pipeline layer `index` (the pickles of older checkpoints were
    `layer_<ii>-model_states.pt`)."""
    return Path(checkpoint_dir) / f"layer_{index:02d}-model_states.safetensors"


def read_layer_state(checkpoint_dir, index: int) -> tuple[dict, Path]:
    """The saved tensors of pipeline layer `index` and the file they came from."""
    path = layer_file(checkpoint_dir, index)
    if path.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path), path
        except (SafetensorError, OSError) as error:
            raise CheckpointError(_damaged(path, f"it cannot be read ({error})")) from None
    legacy = Path(checkpoint_dir) / f"layer_{index:02d}-model_states.pt"
    if not legacy.is_file():
        raise CheckpointError(_damaged(path, "the file is missing"))
    try:  # an older checkpoint's pickle, as DeepSpeed wrote it
        return load_pickle(legacy, map_location="cpu"), legacy
    except Exception as error:  # noqa: BLE001 - any unreadable pickle is a damaged file
        raise CheckpointError(_damaged(legacy, f"it cannot be read ({error})")) from None


def check_layer_state(layer, state: dict, path: Path, strict: bool) -> None:
    """Raises CheckpointError unless `state` holds every trainable tensor of `layer` (every
    tensor when `strict`) with its shape, and nothing the layer lacks."""
    own = layer.state_dict()
    wanted = set(own) if strict else {n for n, p in layer.named_parameters() if p.requires_grad}
    missing = sorted(wanted - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(f"{k} {tuple(state[k].shape)} (the layer's: {tuple(own[k].shape)})"
                    for k in set(state) & set(own) if tuple(state[k].shape) != tuple(own[k].shape))
    wrong = [f"{len(missing)} tensors missing (e.g. {', '.join(missing[:3])})" if missing else "",
             f"{len(unexpected)} unknown tensors (e.g. {', '.join(unexpected[:3])})"
             if unexpected else "",
             f"other shapes: {'; '.join(shapes[:3])}" if shapes else ""]
    wrong = [w for w in wrong if w]
    if wrong:
        raise CheckpointError(_damaged(path, "; ".join(wrong)))


def _damaged(path: Path, why: str) -> str:
    return (f"cannot load the checkpoint file {path}: {why}. This checkpoint does not belong to "
            f"this model or is damaged: delete its folder {path.parent} to resume from the "
            "previous checkpoint, or train from scratch with `train.resume=false`.")
