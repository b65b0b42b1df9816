"""Frame conditioning of video families: which given frames a training sample (or a sample
request) conditions on. One scheme for every video family; `ModelSpec.frame_modes` says which of
these modes a checkpoint takes, and `NoisedBatch.frame_mode` carries each sample's mode as its
index in `FRAME_MODES`."""

from __future__ import annotations

# In the order of the `dataset.conditioning` keys; a sample's mode travels as its index here.
FRAME_MODES = ("none", "first", "last", "both")
NONE, FIRST, LAST, BOTH = range(len(FRAME_MODES))


def takes_first(mode: int) -> bool:
    return mode in (FIRST, BOTH)


def takes_last(mode: int) -> bool:
    return mode in (LAST, BOTH)
