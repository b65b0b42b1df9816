"""Per-sample random streams that every pipeline stage can derive on its own.

The first stage needs the noisy input and the last stage the target of the same sample. Both
derive noise and timesteps from (seed, step, sample index), so no stage has to send them.
Resuming at step k reproduces exactly the noise an uninterrupted run drew at step k.
"""

from __future__ import annotations

import hashlib

import torch


def sample_generator(seed: int, step: int, sample_index: int, stream: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{step}/{sample_index}/{stream}".encode()).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen
