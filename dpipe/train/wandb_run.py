"""The wandb run of a training run (train.loggers=[..., wandb]), on rank 0.

It mirrors TensorBoard (`sync_tensorboard`): every scalar and sample image the run writes
there, at the same steps, so the two never disagree and no call site logs twice. One wandb run
per run dir: its id is kept in <run>/wandb_id, and a resume continues that run.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from omegaconf import OmegaConf

from dpipe.config.schema import RunConfig
from dpipe.io import atomic_write_text

ID_FILE = "wandb_id"


def start_wandb(run: RunConfig, run_dir: Path):
    """wandb.init, before TensorBoard's writer exists (the mirror patches it)."""
    import wandb

    id_file = run_dir / ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:16]
    atomic_write_text(id_file, run_id)
    cfg = run.train.wandb
    return wandb.init(
        dir=str(run_dir), project=cfg.project, entity=cfg.entity, name=cfg.name or run_dir.name,
        tags=list(cfg.tags), mode=cfg.mode, id=run_id, resume="allow",
        config=OmegaConf.to_container(OmegaConf.structured(run), resolve=True),
        sync_tensorboard=True,
        # console="off": wandb would otherwise wrap stdout and stderr, which tqdm and the
        # workers' logging write to.
        settings=wandb.Settings(console="off", quiet=True))
