"""DeepSpeed's pickles in a checkpoint (`mp_rank_*_model_states.pt`, ZeRO's optimizer states,
an older checkpoint's `layer_*-model_states.pt`), read without running code.

torch.load with `weights_only=True` rebuilds tensors, containers and plain values only; any other
object a pickle names is refused, so a planted pickle cannot run code when a run resumes. What
DeepSpeed saves beyond those (its own classes in the optimizer state) is allowed by name in
`ALLOWED`, found by saving a checkpoint with every optimizer and precision dpipe offers.
DeepSpeed itself loads with `weights_only=False`: `reading_safely` routes its loads here.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

import torch

from dpipe.errors import UserError


def _allowed() -> list:
    """The classes DeepSpeed's optimizer states (ZeRO-1, bf16) hold besides tensors and
    builtins: its loss scalers, the ZeRO stage enum and the address of each parameter's slice in
    the flat buffers. Each is rebuilt from plain values without calling its __init__."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class UnsafeCheckpoint(UserError):
    """A checkpoint pickle names an object that a checkpoint's state never holds."""


def load_pickle(path, map_location=None):
    """torch.load of a checkpoint pickle with weights_only=True and DeepSpeed's few classes."""
    with torch.serialization.safe_globals(_allowed()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpoint(
                f"{path} names objects that a checkpoint's state never holds, and which would "
                f"run code when loaded ({str(error).splitlines()[0]}); it was not loaded. Delete "
                f"its checkpoint {Path(path).parent} to resume from the previous one, or train "
                "from scratch with `train.resume=false`") from None


@contextlib.contextmanager
def reading_safely(engine):
    """DeepSpeed's checkpoint loads in this block go through `load_pickle`."""
    reader = engine.checkpoint_engine
    reader.load = lambda path, map_location=None: load_pickle(Path(path), map_location)
    try:
        yield
    finally:
        del reader.load  # the class's own again
