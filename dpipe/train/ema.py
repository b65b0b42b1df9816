"""An exponential moving average (EMA) of this rank's trainable weights (`train.ema`).

Each pipeline stage averages the weights of its own layers, so the average is sharded per stage
like the optimizer state. Data-parallel replicas hold the same weights, hence the same average:
one replica of each stage (data-parallel rank 0) writes it into each checkpoint, as
`ema-stage-<s>.safetensors`, which the checkpoint's COMPLETE lists and verifies. The average is
kept in fp32 whatever the weights' dtype, beside them on their device or in host memory
(`train.ema.cpu`).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from dpipe.config.schema import EmaConfig

log = logging.getLogger("dpipe")

UPDATES = "updates"  # the file's metadata key: how many updates made the average


def file_name(stage: int) -> str:
    return f"ema-stage-{stage:03d}.safetensors"


def decay_at(update: int, decay: float, warmup: bool) -> float:
    """The decay of the `update`-th update (1, 2, ...). With warmup it is (1 + k) / (10 + k)
    until that reaches `decay`: early on the average follows the weights instead of staying
    near their starting point (a LoRA's B matrices start at zero) for ~1 / (1 - decay) steps."""
    return min(decay, (1 + update) / (10 + update)) if warmup else decay


class WeightAverage:
    """The EMA of the trainable parameters of `module` (this rank's pipeline stage)."""

    def __init__(self, module: torch.nn.Module, cfg: EmaConfig, stage: int, writes: bool):
        """`writes`: this rank writes the stage's average into checkpoints (one replica does)."""
        self.cfg, self.stage, self.writes = cfg, stage, writes
        self.named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.average = [p.detach().to(device="cpu" if cfg.cpu else p.device,
                                      dtype=torch.float32, copy=True) for _, p in self.named]
        self.updates = 0

    @property
    def nbytes(self) -> int:
        """The bytes this rank writes into a checkpoint."""
        return sum(a.numel() * a.element_size() for a in self.average) if self.writes else 0

    def due(self, step: int) -> bool:
        return step % self.cfg.every_steps == 0

    @torch.no_grad()
    def update(self) -> None:
        """average <- d * average + (1 - d) * weights, after an optimizer step."""
        self.updates += 1
        weight = 1.0 - decay_at(self.updates, self.cfg.decay, self.cfg.warmup)
        params = [p.detach() for _, p in self.named]
        if all(p.dtype == torch.float32 and p.device == a.device
               for p, a in zip(params, self.average)):
            torch._foreach_lerp_(self.average, params, weight)  # one launch for all tensors
            return
        for average, p in zip(self.average, params):  # one fp32 copy at a time, not all at once
            average.lerp_(p.to(average.device, torch.float32), weight)

    @contextlib.contextmanager
    def swapped_in(self):
        """The average in the model's parameters (cast to their dtype) for samples and exports;
        the training weights come back from a copy in host memory, bit for bit, so training
        continues exactly as if nothing had been swapped."""
        params = [p for _, p in self.named]
        with torch.no_grad():
            training = [p.detach().to("cpu", copy=True) for p in params]
            for p, average in zip(params, self.average):
                p.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(params, training):
                    p.copy_(saved)

    def write(self, folder: Path) -> None:
        """This stage's average into the checkpoint `folder` (on the writing replica only)."""
        if not self.writes:
            return
        from safetensors.torch import save

        from dpipe.io import atomic_write_bytes

        tensors = {name: a.cpu() for (name, _), a in zip(self.named, self.average)}
        atomic_write_bytes(folder / file_name(self.stage),
                           save(tensors, metadata={UPDATES: str(self.updates)}))

    def resume(self, folder: Path, step: int, logs: bool) -> None:
        """Continues the average saved in the checkpoint `folder`; a checkpoint without one
        (trained with train.ema.decay=0) starts it from the loaded weights. `logs`: this rank
        says which."""
        path = folder / file_name(self.stage)
        if not path.is_file():
            if logs:
                log.info("checkpoint %s holds no EMA (it was trained with train.ema.decay=0): "
                         "the EMA starts from its weights at step %d", folder.name, step)
            return
        from safetensors import safe_open

        from dpipe.train.checkpoint import CheckpointError

        with safe_open(path, framework="pt") as f:
            saved = {name: f.get_tensor(name) for name in f.keys()}
            updates = int((f.metadata() or {}).get(UPDATES, 0))
        own = {name: tuple(p.shape) for name, p in self.named}
        if {k: tuple(t.shape) for k, t in saved.items()} != own:
            raise CheckpointError(
                f"cannot load the checkpoint file {path}: its tensors are not this stage's "
                "trainable weights (names or shapes differ). Delete the folder "
                f"{folder} to resume from the previous checkpoint, or resume with "
                "train.ema.decay=0 to train on without the EMA.")
        with torch.no_grad():
            for (name, _), average in zip(self.named, self.average):
                average.copy_(saved[name])
        self.updates = updates
