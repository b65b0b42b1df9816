"""`dpipe-train --help`: dpipe's own help, with the config groups and options read from conf/.

Hydra's stock help describes Hydra (and suggests `+key=`, which dpipe refuses); a user needs what
dpipe does, which groups and options exist, and a few commands to start from. The groups and
their options are listed from the config folder at run time, so a new option file shows up here
with no change to this module.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

EXAMPLES = [
    ("the tiny demo: a generated dataset, 2 pipeline stages in 2 CPU processes",
     "dpipe-train train=demo sample=demo"),
    ("a LoRA on FLUX.1-dev and a folder of images: two stages on two GPUs, one on one GPU",
     "dpipe-train model=flux model.path=/models/FLUX.1-dev dataset=folder "
     "dataset.path=/data/photos 'dataset.resolutions=[1024]' train.precision=bf16"),
    ("print the composed config (every key, its value) without running",
     "dpipe-train --cfg job model=flux pipeline=four_stage optim.lr=2e-5"),
    ("a sweep: one run dir per point, multirun/<name>/<date>_<time>/<num>_<swept keys>/",
     "dpipe-train -m optim.lr=1e-4,5e-5 model.lora.rank=16,32"),
    ("the same sweep as a SLURM job array (docs/cluster.md)",
     "dpipe-train cluster=slurm_gpu optim.lr=1e-4,5e-5"),
]

DOCS = ("README.md (quick start, real models, datasets, outputs), docs/models.md (one page per "
        "family), docs/cluster.md (SLURM, torchrun), docs/performance.md, CHANGELOG.md")


def group_options(conf_dir: Path) -> dict[str, list[str]]:
    """Each config group (a folder of conf_dir) and its options (the .yaml files in it)."""
    return {folder.name: sorted(p.stem for p in folder.glob("*.yaml"))
            for folder in sorted(conf_dir.iterdir()) if folder.is_dir()}


def group_defaults(conf_dir: Path) -> dict[str, str | None]:
    """The option that config.yaml's defaults list picks for each group (None: no option)."""
    config = yaml.safe_load((conf_dir / "config.yaml").read_text()) or {}
    picked: dict[str, str | None] = {}
    for entry in config.get("defaults", []):
        if isinstance(entry, dict):
            for key, value in entry.items():
                picked[key.removeprefix("optional ").strip()] = value
    return picked


def help_text(conf_dir: Path, prog: str = "dpipe-train") -> str:
    width = 100
    lines = [
        f"usage: {prog} [--cfg job] [-m] [--plan [--machine NxGiB]] [key=value | group=option ...]",
        "",
        "Fine-tunes a diffusion model (LoRA or full weights) with DeepSpeed pipeline parallelism:",
        "it composes the run config from conf/ and the command line, checks it, starts one worker",
        "process per GPU (CPU processes without one) and trains, resuming a run of the same name.",
        "Outputs go to outputs/<name>/ (checkpoints, exports, samples, metrics, train.log); the",
        "default name is <model>-<dataset folder's name>. The default pipeline (two stages) runs",
        "one stage where one GPU is visible; pipeline=auto chooses the layout that fits. --plan",
        "prints what the run needs of this machine's GPUs, host memory and cache disk (or of one",
        "named: --machine 1x24,host=64; without GPUs, of the one an experiment preset names)",
        "without running, and the smallest change if it does not fit.",
        "",
        "Config groups (pick one option with group=option; the default is marked *):",
    ]
    defaults = group_defaults(conf_dir)
    for group, options in group_options(conf_dir).items():
        if not options:
            continue
        marked = [f"{o}*" if defaults.get(group) == o else o for o in options]
        lines += textwrap.wrap(", ".join(marked), width=width,
                               initial_indent=f"  {group + ':':<12}", subsequent_indent=" " * 14,
                               break_on_hyphens=False)
    lines += [
        "  local:      conf/local/default.yaml, if it exists (git-ignored: this machine's "
        "settings)",
        "",
        "Keys: set any key of the composed config with key=value (e.g. optim.lr=2e-5,",
        "train.max_steps=2000); `--cfg job` prints them all. Keys cannot be added with `+key=`:",
        "a misspelt key is refused with the valid keys of its group.",
        "",
        "Examples:",
    ]
    for what, command in EXAMPLES:
        lines.append(f"  # {what}")
        lines += textwrap.wrap(command, width=width, initial_indent="  ", subsequent_indent="      ",
                               break_on_hyphens=False, break_long_words=False)
    lines += ["", "Options:",
              "  --cfg job        print the composed config and exit",
              "  -m, --multirun   run a sweep over comma-separated values",
              "  --config-dir D   add a folder of config files (e.g. your own dataset/ options)",
              "  --hydra-help     Hydra's own options",
              "", *textwrap.wrap(f"Docs: {DOCS}.", width=width)]
    return "\n".join(lines) + "\n"


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)
