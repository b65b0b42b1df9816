"""DeepSpeed checkpoints in the run dir, and finding the newest *complete* one.

A checkpoint is `<run_dir>/checkpoints/step_<N>/`. Every rank writes its part, then rank 0 adds
COMPLETE (atomically) once all ranks have finished; a folder without it is a checkpoint that was
interrupted and is never loaded. COMPLETE lists every file with its size and sha256: a resume
verifies them before DeepSpeed reads any pickle, and a damaged checkpoint is skipped for the
previous one. A COMPLETE without that list (an older dpipe's, or an edited one) leaves its files
unverified: such a checkpoint is used only with `train.resume_unverified=true`. Even then no
pickle runs code: every one is read with weights_only (dpipe.pipeline.checkpoint_pickles). The run
config is saved beside it, so a resume can compare.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dpipe.config.run_name import dataset_folders, same_folders
from dpipe.errors import ConfigError
from dpipe.io import atomic_write_text
from dpipe.models.fingerprint import sha256_of
from dpipe.pipeline.checkpoint_pickles import reading_safely
from dpipe.pipeline.layer_files import CheckpointError
from dpipe.train.shared_write import write_together

MARKER = "COMPLETE"
PREFIX = "step_"
CONFIG = "config.yaml"  # the resolved run config the checkpoint was written with

log = logging.getLogger("dpipe")

# Settings a checkpoint cannot follow on resume, and why. Every other change (steps, learning
# rate, schedule, logging, data settings (not the dataset's folders), batch size, seed) is
# allowed, logged and applied: the optim.* values replace the loaded optimizer's
# (dpipe.train.engine_setup.apply_optim_config).
INCOMPATIBLE = {
    "model.family": "another model",
    "model.mode": "LoRA and full fine-tunes save different tensors",
    "model.lora.rank": "the LoRA tensors' shapes",
    "model.lora.alpha": "the LoRA scale the adapters were trained with",
    "model.lora.targets": "which modules have LoRA tensors",
    "model.audio": "which modules have LoRA tensors and which layers the stages hold (the audio "
                   "stream of LTX-2 / LTX-2.3)",
    "pipeline.stages": "the optimizer state is saved per stage (the per-layer weights would load, "
                       "the optimizer state does not)",
    "pipeline.partition": "which layers each stage (and its optimizer state) holds",
    "pipeline.split": "which layers each stage (and its optimizer state) holds",
    "pipeline.zero_stage": "the optimizer state's layout",
    "optim.name": "each optimizer keeps its own state (moments, estimates)",
    "optim.param_groups": "which parameters each optimizer group holds (their `match` "
                          "patterns; a changed lr or weight_decay is followed)",
}
# Full fine-tunes in bf16 keep fp32 master weights in DeepSpeed's bf16 optimizer; and only
# full fine-tunes train 1-D parameters (LoRA's are matrices), which weight_decay_1d moves
# between parameter groups.
INCOMPATIBLE_FULL = {"train.precision": "the optimizer state's layout (bf16 vs fp32)",
                     "optim.weight_decay_1d": "the optimizer's parameter groups (1-D parameters "
                                              "with or without weight decay)"}
# ...or, with optim.master_weights=false, train the bf16 weights in a plain AdamW.
INCOMPATIBLE_FULL_BF16 = {
    "optim.master_weights": "the optimizer state's layout (DeepSpeed's fp32 master weights or "
                            "a plain AdamW over the bf16 weights)",
}

# Keys newer than some checkpoints, with the value that does what the versions before the key
# did: a checkpoint whose config lacks one compares as that value.
BEFORE_THE_KEY = {"optim.weight_decay_1d": True}  # dpipe 0.1.0 of 2026-12-04 and before
# train.ema and sample.ema came after dpipe 0.1.0: no EMA.
BEFORE_THE_KEY.update({"train.ema.decay": 0.0, "train.ema.cpu": False, "train.ema.every_steps": 1,
                       "train.ema.warmup": True, "sample.ema": False})


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def tag_for(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.glob(f"{PREFIX}*"):
        # The step is the folder's (tag_for): a damaged COMPLETE is found, and reported, too.
        if (path / MARKER).is_file() and path.name[len(PREFIX):].isdigit():
            found.append((int(path.name[len(PREFIX):]), path))
    return sorted(found)


def newest_complete(run_dir: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def save(engine, run_dir: Path, step: int, config_yaml: str, lora: bool, keep: int,
         extra=None) -> Path:
    """Writes the checkpoint of `step` on every rank (a collective), then its COMPLETE manifest.
    `extra`: this rank's part besides DeepSpeed's (the EMA, dpipe.train.ema), with
    `write(folder)` and `nbytes`; the manifest lists its files like DeepSpeed's.

    A write that fails on any rank (a full disk, a quota, a read-only place) fails on every
    rank: the partial folder is removed and each rank raises the same WriteFailed, which names
    the path, the bytes needed and free, and the previous complete checkpoint, still intact.
    """
    root = checkpoint_root(run_dir)
    tag = tag_for(step)
    path = root / tag
    needed = _bytes_needed(engine, lora, extra.nbytes if extra is not None else 0)
    # DeepSpeed's save has barriers of its own: a rank whose write failed joins its last one.
    _together(lambda: _fresh_folder(root, path) if dist.get_rank() == 0 else None,
              run_dir, path, needed)
    _together(lambda: engine.save_checkpoint(str(root), tag=tag, client_state={"step": step},
                                             exclude_frozen_parameters=lora),
              run_dir, path, needed, joins_barrier=True)
    _together(lambda: extra.write(path) if extra is not None else None, run_dir, path, needed)
    _together(lambda: atomic_write_text(path / CONFIG, config_yaml)
              if dist.get_rank() == 0 else None, run_dir, path, needed)
    files = _hash_files(path)
    if dist.get_rank() == 0:
        manifest = {"step": step, "time": time.time(), "files": files}
    _together(lambda: atomic_write_text(path / MARKER, json.dumps(manifest, indent=1))
              if dist.get_rank() == 0 else None, run_dir, path, needed)
    if dist.get_rank() == 0:
        _prune(run_dir, keep)
    dist.barrier()
    return path


def _fresh_folder(root: Path, path: Path) -> None:
    """The root, and no older folder of this step: a damaged checkpoint that a resume skipped,
    or one interrupted earlier, is written anew, never mixed with its old files."""
    root.mkdir(parents=True, exist_ok=True)
    if path.exists():
        shutil.rmtree(path)


def _together(write, run_dir: Path, path: Path, needed: int, joins_barrier: bool = False) -> None:
    """This rank's part of writing the checkpoint `path`; a failure on any rank removes the
    partial folder and fails every rank, naming the previous complete checkpoint."""
    def what_is_left(rank: int) -> str:
        previous = newest_complete(run_dir)
        kept = (f"the previous complete checkpoint {previous[1]} (step {previous[0]}) is intact, "
                "and the same command resumes from it once there is space" if previous else
                "there is no earlier checkpoint: the run starts from scratch when started again")
        return (f"The partial checkpoint {path.name} was removed (rank {rank} failed to write "
                f"it); {kept}.")

    write_together(write, "the checkpoint", path, needed, [path], what_is_left, joins_barrier)


def _bytes_needed(engine, lora: bool, extra: int = 0) -> int:
    """About how many bytes a checkpoint of this run writes: the saved weights (the trainable
    ones for LoRA), the optimizer state and this rank's `extra` bytes, summed over the ranks (a
    collective)."""
    module = engine.module
    params = [p for p in module.parameters() if p.requires_grad or not lora]
    total = extra + sum(p.numel() * p.element_size() for p in params)
    total += sum(b.numel() * b.element_size() for b in module.buffers()) if not lora else 0
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in getattr(optimizer, "state", {}).values():
        total += sum(t.numel() * t.element_size() for t in state.values()
                     if isinstance(t, torch.Tensor))
    sizes = [0] * dist.get_world_size()
    dist.all_gather_object(sizes, total)
    return int(sum(sizes))


def _hash_files(path: Path) -> dict | None:
    """{relative path: {"size", "sha256"}} of every file in the checkpoint, on rank 0 (None on
    the others); the ranks share the hashing (a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [None]
    if rank == 0:
        names = [sorted(str(p.relative_to(path)) for p in path.rglob("*")
                        if p.is_file() and p.name != MARKER)]
    dist.broadcast_object_list(names, src=0)
    mine = {name: {"size": (path / name).stat().st_size, "sha256": sha256_of(path / name)}
            for i, name in enumerate(names[0]) if i % world == rank}
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    if rank != 0:
        return None
    return dict(sorted((name, entry) for part in parts for name, entry in part.items()))


# Why a checkpoint whose COMPLETE lists no files is not used unless the user says so.
UNVERIFIED = (f"its {MARKER} lists no files to verify them by (an older dpipe wrote it, or it "
              "was edited): any of its files may have been changed or replaced since, and "
              "training would go on from those weights")
RESUME_UNVERIFIED = "train.resume_unverified=true"


def problem(path: Path, unverified_ok: bool = False) -> str | None:
    """What is wrong with the complete checkpoint `path` (a missing, resized or changed file,
    as its COMPLETE lists them), or None when it verifies. A COMPLETE that lists no files
    leaves them unverified: `UNVERIFIED`, or None with a warning when `unverified_ok`."""
    try:
        files = json.loads((path / MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError) as error:
        return f"its {MARKER} cannot be read ({error})"
    if files is None:
        if not unverified_ok:
            return UNVERIFIED
        log.warning("checkpoint %s lists no files in its %s: using it unverified (%s)", path,
                    MARKER, RESUME_UNVERIFIED)
        return None
    for name, entry in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"its file {file} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"its file {file} has {size} bytes, {entry['size']} were written"
        if sha256_of(file) != entry["sha256"]:
            return f"its file {file} changed since it was written (its sha256 differs)"
    return None


# Verdicts of `problem` that this process and the workers it starts share (JSON in the
# environment, which they inherit): a resume hashes each checkpoint's files once, in the
# launcher, and warns of a damaged one once. Keyed by the checkpoint and its COMPLETE's mtime:
# a checkpoint written again is verified again.
VERDICTS = "DPIPE_CHECKPOINT_VERDICTS"


def _verdict(path: Path, unverified_ok: bool) -> tuple[str | None, bool]:
    """(`problem(path)`, whether an earlier verdict of this run's processes gave it)."""
    try:
        key = f"{path.resolve()}@{(path / MARKER).stat().st_mtime_ns}@{int(unverified_ok)}"
    except OSError:
        return problem(path, unverified_ok), False
    known = json.loads(os.environ.get(VERDICTS, "{}"))
    if key in known:
        return known[key], True
    known[key] = problem(path, unverified_ok)
    os.environ[VERDICTS] = json.dumps(known)
    return known[key], False


def newest_verified(run_dir: Path, unverified_ok: bool = False,
                    using: str = "resuming from") -> tuple[int, Path] | None:
    """The newest complete checkpoint whose files verify (None: no complete checkpoint). A
    damaged one is skipped with a warning naming its file and the checkpoint `using` instead;
    raises CheckpointError when every complete one is damaged. `unverified_ok`: a checkpoint
    whose COMPLETE lists no files counts as verified."""
    complete = complete_checkpoints(run_dir)
    damaged = []
    for step, path in reversed(complete):
        wrong, said_before = _verdict(path, unverified_ok)
        if wrong is None:
            for name, why, said in damaged:
                if not said:
                    log.warning("checkpoint %s is damaged: %s; %s %s (step %d) instead", name,
                                why, using, path.name, step)
            return step, path
        damaged.append((path.name, wrong, said_before))
    if not damaged:
        return None
    lines = "\n".join(f"  {name}: {why}" for name, why, _ in damaged)
    trust = (f"; or, if you trust those files, resume with `{RESUME_UNVERIFIED}`"
             if any(why == UNVERIFIED for _, why, _ in damaged) else "")
    raise CheckpointError(
        f"no checkpoint in {checkpoint_root(run_dir)} can be loaded: every complete one is "
        f"damaged or unverified:\n{lines}\nRestore the files from a backup, or train from "
        f"scratch in this run dir with `train.resume=false` (or start a new run with another "
        f"`name=...`){trust}.")


def agreed_resume(run_dir: Path, unverified_ok: bool = False) -> tuple[int, Path] | None:
    """`newest_verified` as rank 0 finds it, the same on every rank (a collective): every rank
    loads the same step, and a CheckpointError is raised by all."""
    answer: list = [None]
    if dist.get_rank() == 0:
        try:
            answer = [("ok", newest_verified(run_dir, unverified_ok))]
        except CheckpointError as error:
            answer = [("error", str(error))]
    dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise CheckpointError(value)
    return None if value is None else (value[0], Path(value[1]))


def load(engine, run_dir: Path, path: Path, lora: bool) -> int:
    """Loads a checkpoint that `agreed_resume` verified: DeepSpeed's pickles are read only then,
    and with weights_only. The layer weights load with a strict key and shape check
    (dpipe.pipeline.engine)."""
    with reading_safely(engine):
        _, client_state = engine.load_checkpoint(
            str(checkpoint_root(run_dir)), tag=path.name, load_module_strict=not lora
        )
    if client_state is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {path}")
    return int(client_state["step"])


def _prune(run_dir: Path, keep: int) -> None:
    complete = complete_checkpoints(run_dir)
    for _, path in complete[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    newest = complete[-1][0] if complete else -1
    # Interrupted checkpoints older than the newest complete one will never be used.
    for path in checkpoint_root(run_dir).glob(f"{PREFIX}*"):
        if not (path / MARKER).exists() and int(path.name[len(PREFIX):]) < newest:
            shutil.rmtree(path, ignore_errors=True)


def resume_changes(saved_yaml: str, current_yaml: str) -> tuple[dict, dict]:
    """(incompatible, harmless) differences between a checkpoint's config and the current one,
    each {key: (saved, current)}."""
    saved = _flat(OmegaConf.to_container(OmegaConf.create(saved_yaml)))
    saved = {**BEFORE_THE_KEY, **saved}
    current = _flat(OmegaConf.to_container(OmegaConf.create(current_yaml)))
    blocking = dict(INCOMPATIBLE)
    if current.get("model.mode") == "full" or saved.get("model.mode") == "full":
        blocking.update(INCOMPATIBLE_FULL)
        if "bf16" in (current.get("train.precision"), saved.get("train.precision")):
            blocking.update(INCOMPATIBLE_FULL_BF16)
    incompatible, harmless = {}, {}
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if old != new:
            follows = key == "optim.param_groups" and _patterns(old) == _patterns(new)
            (incompatible if key in blocking and not follows else harmless)[key] = (old, new)
    return incompatible, harmless


def _patterns(groups) -> list:
    return [group.get("match") for group in groups or []]


def check_resume(run_dir: Path, current_yaml: str, verify: bool = True,
                 unverified_ok: bool = False) -> tuple[int, Path] | None:
    """The checkpoint a resume will start from, after checking that the current config can use
    it: raises ConfigError naming the keys it cannot follow; logs the other changes. It is the
    checkpoint the workers load: the newest one whose files verify (`newest_verified`).
    `verify=False` takes the newest complete one unverified (ranks other than the one that
    verifies: a resume reads each file once, not once per rank)."""
    newest = newest_verified(run_dir, unverified_ok) if verify else newest_complete(run_dir)
    if newest is None:
        return None
    step, path = newest
    if not (path / CONFIG).is_file():
        log.warning("checkpoint %s has no %s: resuming without checking the config", path, CONFIG)
        return newest
    saved_yaml = (path / CONFIG).read_text()
    _refuse_another_dataset(run_dir, path, step, saved_yaml, current_yaml)
    incompatible, harmless = resume_changes(saved_yaml, current_yaml)
    if incompatible:
        why = {**INCOMPATIBLE, **INCOMPATIBLE_FULL, **INCOMPATIBLE_FULL_BF16}
        lines = "\n".join(f"  {k}: {_show(old)} in the checkpoint, {_show(new)} now ({why[k]})"
                          for k, (old, new) in incompatible.items())
        raise ConfigError(
            f"cannot resume {run_dir} from its checkpoint {path.name} (step {step}): these settings "
            f"differ from the checkpoint's, which cannot follow them:\n{lines}\n"
            "Start a new run instead: another `name=...` (or `hydra.run.dir=...`), or "
            "`train.resume=false` to train from scratch in this run dir."
        )
    if harmless:
        changes = ", ".join(f"{k} {_show(old)} -> {_show(new)}" for k, (old, new) in harmless.items())
        log.info("resuming from %s with changed settings: %s", path.name, changes)
    return newest


def _refuse_another_dataset(run_dir: Path, path: Path, step: int, saved_yaml: str,
                            current_yaml: str) -> None:
    """A resume trains on the checkpoint's folders (files added to them are new data of the
    same run); other folders are another run, which must not continue this one's weights."""
    old, new = dataset_folders(saved_yaml), dataset_folders(current_yaml)
    if same_folders(old, new):
        return
    name = OmegaConf.create(current_yaml).get("name") or "run"
    suggested = f"{name}-{Path(new[0]).name}" if new else f"{name}-2"
    raise ConfigError(
        f"cannot resume {run_dir} from its checkpoint {path.name} (step {step}): it trained on "
        f"another dataset.\n  dataset folders in the checkpoint: {', '.join(old) or '(none)'}\n"
        f"  dataset folders now: {', '.join(new) or '(none)'}\n"
        f"A different dataset is a new run: give it another name, e.g. `name={suggested}` (or "
        "`hydra.run.dir=...`); or `train.resume=false` to train from scratch in this run dir. "
        "(Files added to the same folders are fine: such a run resumes.)"
    )


def finished_run(run_dir: Path, max_steps: int, export_dir: Path) -> int | None:
    """The step of a run with nothing left to do (None if it has): its newest complete
    checkpoint is at `max_steps` or later, and `export_dir` (`<run>/lora` or `<run>/model`)
    holds the final export written after that checkpoint (an export from an earlier, shorter
    run does not count, nor a folder of step exports only)."""
    newest = newest_complete(run_dir)
    if newest is None or newest[0] < max_steps or not export_dir.is_dir():
        return None
    step, path = newest
    final_export = [p for p in export_dir.iterdir() if not p.name.startswith(PREFIX)]
    if not final_export or export_dir.stat().st_mtime < (path / MARKER).stat().st_mtime:
        return None
    return step


def _flat(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix.rstrip("."): node}
    out: dict = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value) -> str:
    return "(unset)" if value is None else repr(value) if isinstance(value, str) else str(value)
