"""What only the files can tell, checked in the launcher before any worker starts (in the workers
each would fail at once, after every process had started and loaded its libraries): the run dir,
the cache dir, the dataset's folders, the model's weight files and adapters, the resolutions, the
frame modes of `dataset.conditioning` and the pipeline against the model's layer count."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dpipe.config.schema import DatasetKind, RunConfig
from dpipe.data.conditioning import check_micro_batches, frame_probabilities
from dpipe.data.sources import check_directory
from dpipe.errors import ConfigError, UserError
from dpipe.models.safetensors_files import check_folder_files
from dpipe.pipeline.attention import require_gpu_kernel
from dpipe.train.adapter_init import check_adapter_file


def _check_resolutions(run: RunConfig, spec) -> None:
    """Every resolution holds the model's pixel multiple (the buckets would fail in the workers,
    after the cache was planned)."""
    try:
        multiple = spec.pixel_multiple
    except (OSError, KeyError, UserError):  # a tiny model made by the first worker: checked there
        return
    d = run.dataset
    given = [("dataset.resolutions", d.resolutions)]
    given += [(f"dataset.directories[{i}].resolutions", x.resolutions)
              for i, x in enumerate(d.directories) if x.resolutions]
    for key, values in given:
        small = [r for r in values if r < multiple]
        if small:
            raise ConfigError(f"{key}={list(values)}: {small[0]} is smaller than the model's pixel "
                              f"multiple {multiple} (image sides are multiples of it): use "
                              f"{multiple} or more")


def _check_frame_modes(run: RunConfig, spec) -> None:
    """dataset.conditioning sums to 1 and names only modes the checkpoint takes."""
    try:
        spec.frame_modes()  # Wan reads what the checkpoint takes from its folder's configs
    except (OSError, KeyError, UserError):  # a tiny model made by the first worker: checked there
        return
    probabilities = frame_probabilities(spec, run.dataset)
    sizes = [run.pipeline.micro_batch_size] + [r.micro_batch_size for r in
                                               run.dataset.micro_batch_sizes if r.frames != 1]
    check_micro_batches(spec, probabilities, [s for s in sizes if isinstance(s, int)])


def check_before_workers(run: RunConfig, run_dir, spec) -> None:
    """What only the files can tell, checked before any worker starts (in the workers each
    would fail at once, after every process had started and loaded its libraries): the run dir
    is writable, `dataset.cache_dir` can be a folder, the dataset's folders exist, a GPU
    attention kernel has a GPU, and the pipeline fits the model's layer count where the family
    reads it from its config."""
    try:
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as err:
        raise ConfigError(f"the run dir {run_dir} is not writable ({err.strerror}): choose "
                          "another (`name=...` or `hydra.run.dir=...`) or fix its "
                          "permissions") from None
    cache = Path(run.dataset.cache_dir).expanduser()
    existing = next(p for p in (cache, *cache.parents) if os.path.lexists(p))
    if not existing.is_dir():
        where = "is a file" if existing == cache else f"is inside {existing}, which is a file"
        raise ConfigError(f"dataset.cache_dir={run.dataset.cache_dir} {where}: give a folder "
                          "(it is created if missing)")
    if run.dataset.kind == DatasetKind.folder:  # a synthetic dataset's folder is drawn into
        folders = [("dataset.path", run.dataset.path)] if run.dataset.path else []
        folders += [("dataset.directories", d.path) for d in run.dataset.directories]
        for eval_set in run.dataset.eval.sets:
            folders += [(f"dataset.eval.sets[name={eval_set.name}]", d.path)
                        for d in eval_set.directories]
        for key, folder in folders:
            check_directory(Path(folder), what=f"{key} folder")
    spec.use_loss(run.train)  # a family refuses the loss settings it cannot apply
    # The workers run on this machine (the launcher of a torchrun or SLURM job checks nothing
    # here: each rank checks in trainable_layers).
    require_gpu_kernel(run.model.attention)
    # An empty or cut-short weights file (a download or copy that stopped), from its header.
    check_folder_files(Path(run.model.path).expanduser(), "model.path=")
    if run.model.single_file_config:
        check_folder_files(Path(run.model.single_file_config).expanduser(),
                           "model.single_file_config=")
    check_adapter_files(run, spec)
    _check_resolutions(run, spec)
    _check_frame_modes(run, spec)
    layers = spec.pipeline_layer_count()
    p = run.pipeline
    if layers is not None and p.stages > layers:
        raise ConfigError(f"pipeline.stages={p.stages} but the model has only {layers} pipeline "
                          f"layers: use pipeline.stages <= {layers}")
    if layers is not None and p.split and p.split[-1] >= layers:
        raise ConfigError(f"pipeline.split={p.split}: layer indices must be < {layers} (the "
                          "model's layer count)")


def check_adapter_files(run: RunConfig, spec) -> None:
    """model.lora.init_from and model.merge_adapters name readable adapter files of a layout
    dpipe reads (dpipe.models.lora_read), before any worker starts; their modules and shapes are
    checked against the model on every stage (dpipe.train.adapter_init)."""
    m = run.model
    if m.lora.init_from:
        _, _, kind = check_adapter_file(m.lora.init_from, "model.lora.init_from")
        if kind != m.adapter:
            raise ConfigError(
                f"model.lora.init_from={m.lora.init_from} holds a {kind.value} adapter, but this "
                f"run trains model.adapter={m.adapter.value}: set model.adapter={kind.value}, or "
                f"give a {m.adapter.value} file")
    for i, file in enumerate(m.merge_adapters):
        check_adapter_file(file, f"model.merge_adapters[{i}]")
