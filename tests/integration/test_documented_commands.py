"""Every command the docs show runs end to end on a tiny model, in CI.

tests/unit/test_docs_commands.py finds the commands (README.md, docs/*.md, docs/models/*.md) and
composes and validates each in-process. Here each one runs with the arguments a user types, in
a folder of its own (its `outputs/` and `multirun/` there): composition, Hydra's launch (sweep
dirs included), the config checks, the workers, caching and at least one training step (or one
sample, one export, one cache pass, one benchmark step). The arguments change only as MAPPING
says: the real models become their family's tiny model, the dataset folders a generated folder
of 64 px images (`/data/photos`) or images and clips with sound (`/data/clips`), and a run stops
after one step.

Runs are shared: documented `dpipe-train` commands that are the same after the mapping run once,
and those that differ only in `model=` run as one `-m` sweep over their models (each point is
exactly its command). A command that reads another's output (`dpipe-lora merge` of a
`convert`'s folder) runs after it. Each runs through its console script's `main()` in the test
process (tests/cli.py: the code of the typed command from its arguments on, the workers real
processes); README's first `dpipe-train` line and the SLURM lines start the console script as a
process (`as_typed`), the SLURM lines on the session's local SLURM
(tests/integration/test_slurm.py's `slurm` fixture). Three commands run in tests that check
more (RUN_BY_TESTS: README's `-m` sweep, the demo, docs/cluster.md's SLURM sweep).
`test_every_documented_command_is_run` checks that every command has its run. A command that
fails names its doc file and line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.cli import REPO, dpipe_command, dpipe_train
from tests.integration.documented_files import write_edits, write_flux_files
from tests.integration.test_slurm import slurm  # noqa: F401  (the session's local SLURM)
from tests.unit.test_docs_commands import COMMANDS, Command, program_of
from tests.unit.test_data_support import write_image, write_video

pytestmark = pytest.mark.slow

# --- The mapping table: the only place a documented command's arguments change ---------------

MAPPING = {
    # model=<real family> -> its tiny model (a preset's `override /model` too)
    "model": {
        "anima": "tiny_anima", "auraflow": "tiny_auraflow", "chroma": "tiny_chroma",
        "cosmos1": "tiny_cosmos1", "cosmos_predict2": "tiny_cosmos_predict2",
        "ernie_image": "tiny_ernie_image", "flux": "tiny_flux", "flux2": "tiny_flux2",
        "flux_kontext": "tiny_flux_kontext", "hidream": "tiny_hidream",
        "hunyuan_image": "tiny_hunyuan_image", "hunyuan_video": "tiny_hunyuan_video",
        "hunyuan_video15": "tiny_hunyuan_video15", "ideogram4": "tiny_ideogram4",
        "krea2": "tiny_krea2", "ltx2": "tiny_ltx2", "ltx23": "tiny_ltx23",
        "ltx_video": "tiny_ltx_video", "lumina2": "tiny_lumina2",
        "minimax_h3": "tiny_minimax_h3", "omnigen2": "tiny_omnigen2",
        "qwen_image": "tiny_qwen_image", "qwen_image_edit": "tiny_qwen_image_edit",
        "qwen_image_edit_plus": "tiny_qwen_image_edit_plus",
        "sd3": "tiny_sd3", "sdxl": "tiny_sdxl", "wan": "tiny_wan",
        "wan22_high_noise": "tiny_wan22_a14b", "wan22_low_noise": "tiny_wan22_a14b",
        "z_image": "tiny_z_image"},
    # keys dropped: the weights on disk (a tiny model is made at first use)
    "dropped": ["model.path", "model.single_file_config"],
    # ... but where the weights choose the checkpoint's task (the family reads it from the
    # folder), the tiny model of that task replaces the command's (or its preset's) model
    "variants": {"/models/Wan2.2-I2V-A14B-Diffusers": "tiny_wan22_i2v_a14b",
                 "/models/Wan2.1-FLF2V-14B-720P-diffusers": "tiny_wan_flf2v"},
    # paths the docs name (in any argument, e.g. a sample's control image) -> generated folders
    # (@photos@: 64 px images with captions and control/ images; @clips@: two images and two
    # clips with sound, 130 and 40 frames at 24 fps; @run@ and @lora@: README's first training
    # run, e.g. `dpipe-train model=flux ... dataset.path=/data/my_photos`, and its LoRA file;
    # @edits@: images with two references each; @files@: what docs/lora-files.md assumes a
    # user has, tests/integration/documented_files.py says what, and where its outputs go;
    # a first and a last frame: two of the photos). Replaced in this order.
    "paths": {"/shared/data/photos": "@photos@", "/data/my_photos": "@photos@",
              "/data/photos": "@photos@", "/data/art": "@photos@", "/data/clips": "@clips@",
              "/data/edits": "@edits@", "/data/dog.png": "@photos@/dog.png",
              "/data/start.png": "@photos@/cat.png", "/data/end.png": "@photos@/ball.png",
              "/data/dog_end.png": "@photos@/ball.png",
              # a sample's size: a 768x1024 image is 40 s of a tiny model's VAE on this CPU
              "width: 768, height: 1024": "width: 96, height: 128",
              "/loras/style.safetensors": "@lora@", "outputs/my_run": "@run@",
              "/loras/": "@files@/loras/", "/models/": "@files@/models/",
              "outputs/my_full_run": "@files@/my_full_run",
              "outputs/my_exports_run": "@exports_run@"},  # a 3-step run exporting each step
    # key -> its value here, where the command or its preset (experiment=) sets it, or always
    # (`added`): one step; 64 px (the generated files' size; a tiny model at 1024 px would
    # spend minutes on attention); GPU-only settings off; SLURM's CPU preset and partition
    "values": {"train.max_steps": "1", "dataset.resolutions": "[64]", "sample.steps": "2",
               "pipeline.micro_batches": "2",  # the benchmarks' 8: four times the CPU work
               "pipeline.compile": "false", "model.attention": "auto",
               "cluster": "slurm_cpu", "hydra.launcher.partition": "debug",
               "hydra.launcher.gpus_per_node": "null",
               # dpipe-lora extract / resize: the tiny FLUX.1's narrowest matrix is 16 wide
               "rank": "8"},
    "added": {"dpipe-train": ["train.max_steps"], "folder": ["dataset.resolutions"],
              "sampling": ["sample.steps"]},
    # per tiny model, values only this CPU needs: CPU autocast leaves layer_norm in its input's
    # dtype (CUDA's runs it in fp32), so HunyuanImage's glyph norm and HunyuanVideo 1.5's
    # meet fp32 inputs with bf16 weights and refuse them ("mixed dtype (CPU)")
    "cpu": {"tiny_hunyuan_image": {"train.precision": "fp32"},
            "tiny_hunyuan_video15": {"train.precision": "fp32"}},
    # `dpipe-train --plan` plans for this machine's GPUs, and it has none: README's machine
    "plan": ["--machine", "1x24,host=64"],
    # dpipe-bench: the CPU smoke size, one warm-up and one timed step; no GPU memory cap and
    # no plain reference loop (both CUDA's alone)
    "bench": {"--size": "tiny", "--warmup": "1", "--steps": "1", "--memory-cap-gb": None,
              "--plain": None},
    # make targets run elsewhere (never from inside the suite): why
    "make": {"demo": "tests/integration/test_quick_start.py runs it as a user does",
             "setup": "makes the venv this suite runs in",
             "test": "is this suite", "test-fast": "is this suite without the slow tests",
             "test-docs": "runs this module",
             "test-cluster": "runs the SLURM tests, cluster_full included"},
}
SLURM_CLUSTERS = ("slurm_gpu", "slurm_cpu")
BENCH_SWITCHES = ("--plain", "--loader", "--profile")  # dpipe-bench's flags without a value
# One process's limit (a dpipe-bench of 14 runs took 600 s on a loaded 2-core machine): a stuck
# one fails with its output instead of hanging CI.
TIMEOUT = 1500


# --- Mapping a documented command ------------------------------------------------------------

@dataclass
class Mapped:
    """A documented command as it runs here; `wheres`: every doc line that maps to it."""

    program: str
    args: tuple[str, ...]
    wheres: list[str] = field(default_factory=list)

    @property
    def slurm(self) -> bool:
        return any(a.startswith("cluster=slurm") or a == "hydra/launcher=submitit_slurm"
                   for a in self.args)

    def __str__(self) -> str:
        return f"{self.program} {' '.join(self.args)}"


def _key(arg: str) -> str:
    return arg.partition("=")[0].lstrip("+")


def _preset_keys(name: str) -> tuple[str | None, set[str]]:
    """The model a preset (conf/experiment/NAME.yaml) chooses and the dotted keys it sets."""
    text = yaml.safe_load((REPO / "conf" / "experiment" / f"{name}.yaml").read_text())
    model = next((d["override /model"] for d in text.get("defaults", [])
                  if isinstance(d, dict) and "override /model" in d), None)

    def keys(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from keys(v, f"{prefix}{k}.")
            else:
                yield prefix + k
    return model, set(keys({k: v for k, v in text.items() if k != "defaults"}))


def map_args(program: str, args: list[str]) -> list[str]:
    """`args` of `program` as MAPPING says."""
    values = MAPPING["values"]
    out = []
    variant = next((MAPPING["variants"][a.partition("=")[2]] for a in args
                    if _key(a) == "model.path" and a.partition("=")[2] in MAPPING["variants"]),
                   None)
    if variant:
        args = [a for a in args if _key(a) != "model"] + [f"model={variant}"]
    for arg in args:
        if arg == "...":  # "the overrides shown before": the command runs without them
            continue
        for doc_path, here in MAPPING["paths"].items():
            arg = arg.replace(doc_path, here)
        key, eq, value = arg.partition("=")
        if not eq or arg.startswith("-"):
            out.append(arg)
        elif key in MAPPING["dropped"]:
            continue
        elif key == "model" and variant:
            out.append(arg)
        elif key == "model" and value in MAPPING["model"]:
            out.append(f"model={MAPPING['model'][value]}")
        elif key == "cluster" and value not in SLURM_CLUSTERS:
            out.append(arg)
        elif key in values:
            out.append(f"{key}={values[key]}")
        else:
            out.append(arg)
    if program in ("dpipe-train", "dpipe-sample", "dpipe-cache"):
        out = _with_additions(program, out)
    if "--plan" in out and "--machine" not in out:
        at = out.index("--plan") + 1
        out[at:at] = MAPPING["plan"]
    model = next((a.partition("=")[2] for a in out if a.startswith("model=")), None)
    cpu = MAPPING["cpu"].get(model, {})
    return [f"{_key(a)}={cpu[_key(a)]}" if _key(a) in cpu and "=" in a else a for a in out]


def _with_additions(program: str, out: list[str]) -> list[str]:
    """`out` with the keys of MAPPING["added"] (and of a preset) that it does not set."""
    values = MAPPING["values"]
    keys = {_key(a) for a in out}
    needed = list(MAPPING["added"].get(program, []))
    if "dataset=folder" in out:
        needed += MAPPING["added"]["folder"]
    if any(k in ("sample.prompts", "sample.prompts_file") for k in keys):
        needed += MAPPING["added"]["sampling"]
    for arg in out:
        if _key(arg) == "experiment":
            model, preset = _preset_keys(arg.partition("=")[2])
            needed += [k for k in preset if k in values]
            if model in MAPPING["model"] and "model" not in keys:
                out.append(f"model={MAPPING['model'][model]}")  # the command line's wins
    return out + [f"{k}={values[k]}" for k in dict.fromkeys(needed) if k not in keys]


def map_bench(args: list[str]) -> list[str]:
    """dpipe-bench's flags as MAPPING["bench"] says (set where the command leaves them out, so
    that commands differing only in their runs share a process), then each --run's overrides
    as map_args maps them."""
    flags = {k: v for k, v in MAPPING["bench"].items() if v is not None}
    switches, runs, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--run":
            name, _, overrides = args[i + 1].partition(":")
            runs += [arg, f"{name}: {' '.join(map_args('dpipe-bench-run', overrides.split()))}"]
        elif arg in BENCH_SWITCHES:
            if arg not in MAPPING["bench"]:
                switches.append(arg)
            i += 1
            continue
        elif arg not in MAPPING["bench"]:
            flags[arg] = args[i + 1]
        i += 2
    return [x for kv in flags.items() for x in kv] + sorted(switches) + runs


def documented() -> list[tuple[Command, str, list[str]]]:
    """(command, program, its arguments) of every documented command."""
    return [(c, *program_of(list(c.argv))) for c in COMMANDS]


def _sweeps(args: tuple[str, ...]) -> bool:
    """Whether a dpipe-train command is a sweep (or prints its config) rather than one run."""
    return any(a in ("-m", "--multirun", "--cfg", "-c") or a.startswith("cluster=")
               or a.startswith("hydra/launcher=") for a in args)


def _bench_parts(args: list[str]) -> tuple[tuple[str, ...], list[tuple[str, str]]]:
    """A dpipe-bench command's flags and its (name, overrides) runs."""
    flags, runs, i = [], [], 0
    while i < len(args):
        if args[i] == "--run":
            name, _, overrides = args[i + 1].partition(":")
            runs.append((name.strip(), overrides.strip()))
            i += 2
        else:
            flags.append(args[i])
            i += 1
    return tuple(flags), runs


def processes() -> tuple[list[Mapped], list[str]]:
    """The processes that run every documented command, and the `make` lines not run here.

    Commands the same after mapping run once. One-run `dpipe-train` commands that differ only
    in `model=` run as one `-m model=a,b,...` sweep; `dpipe-bench` commands with the same flags
    as one `dpipe-bench` with all their (distinct) runs. In the order the docs show them."""
    runs: dict[tuple, Mapped] = {}
    made = []
    for command, program, args in documented():
        if program == "make":
            made += [f"{command.where}: make {t}: {MAPPING['make'].get(t, 'NOT MAPPED')}"
                     for t in args]
            continue
        mapped = map_bench(args) if program == "dpipe-bench" else map_args(program, args)
        runs.setdefault((program, tuple(mapped)), Mapped(program, tuple(mapped))).wheres.append(
            command.where)
    groups: dict[tuple, list[Mapped]] = defaultdict(list)
    order: list = []
    for run in runs.values():
        models = [a for a in run.args if a.startswith("model=")]
        if run.program == "dpipe-bench":
            key = ("bench", _bench_parts(list(run.args))[0])
        elif run.program == "dpipe-train" and len(models) == 1 and not _sweeps(run.args):
            key = ("train", tuple(a for a in run.args if not a.startswith("model=")))
        else:
            order.append(run)
            continue
        if not groups[key]:
            order.append(key)  # the group's place in the order
        groups[key].append(run)
    return [item if isinstance(item, Mapped) else _merged(item, groups[item]) for item in order], made


def _same_run(program: str, args: list[str]) -> tuple | None:
    """The run config that a one-run `dpipe-train` command of the default model composes: the
    commands that only spell out defaults (README's `dpipe-train`, `dpipe-train model=tiny_flux`
    and docs/cluster.md's `dpipe-train optim.lr=1e-4`) are one run, made once. None for other
    commands."""
    models = [a for a in args if a.startswith("model=")]
    if (program != "dpipe-train" or _sweeps(tuple(args)) or any(a.startswith("-") for a in args)
            or models not in ([], ["model=tiny_flux"])):
        return None
    from dataclasses import asdict

    from dpipe.config.compose import compose_run

    return ("run config", repr(asdict(compose_run(list(args)))))


def _merged(key: tuple, members: list[Mapped]) -> Mapped:
    wheres = [w for m in members for w in m.wheres]
    if len(members) == 1:
        return members[0]
    if key[0] == "train":
        models = ",".join(dict.fromkeys(a.partition("=")[2] for m in members for a in m.args
                                        if a.startswith("model=")))
        return Mapped("dpipe-train", ("-m", f"model={models}", *key[1]), wheres)
    runs: dict[str, str] = {}  # overrides -> name
    for member in members:
        for name, overrides in _bench_parts(list(member.args))[1]:
            if overrides not in runs:
                taken = set(runs.values())
                runs[overrides] = name if name not in taken else f"{name}-{len(taken)}"
    args = list(key[1])
    for overrides, name in runs.items():
        args += ["--run", f"{name}: {overrides}"]
    return Mapped("dpipe-bench", tuple(args), wheres)


PROCESSES, MAKE_ELSEWHERE = processes()

# Documented commands that a test of CI runs as mapped here, checking more than this module
# would: one process serves both, and this module does not run them again. Each such test takes
# its command from `documented_command`, which fails once the docs no longer show it.
RUN_BY_TESTS = {
    "dpipe-train -m optim.lr=1e-4,5e-5 model.lora.rank=16,32 train.max_steps=1":
        "tests/integration/test_sweeps.py::test_the_documented_sweep_runs_as_written",
    # the Makefile's demo line, which the test runs to its end (120 steps) rather than 1 step
    "dpipe-train train=demo sample=demo train.max_steps=1":
        "tests/integration/test_quick_start.py::"
        "test_make_demo_trains_learns_and_leaves_the_documented_outputs",
    "dpipe-train cluster=slurm_cpu optim.lr=1e-4,5e-5 train.max_steps=1":
        "tests/integration/test_slurm.py::test_sweep_runs_as_a_job_array_of_two_task_jobs",
}


def documented_command(command: str) -> Mapped:
    """The documented command (as mapped here) that prints as `command`, for the tests of
    RUN_BY_TESTS to run."""
    assert command in RUN_BY_TESTS, f"`{command}` is not in RUN_BY_TESTS"
    found = [p for p in PROCESSES if str(p) == command]
    assert found, (f"no documented command maps to `{command}` any more: update RUN_BY_TESTS "
                   f"and {RUN_BY_TESTS[command]}")
    return found[0]
# The run that `outputs/my_run` and `/loras/style.safetensors` stand for: README's first
# training command on a dataset folder.
FIRST_RUN = next(c.where for c, program, args in documented()
                 if c.where.startswith("README.md") and program == "dpipe-train"
                 and "dataset=folder" in args and any(a.startswith("model=") for a in args))


# --- The files the mapped commands use -------------------------------------------------------

PHOTOS = {"cat": "a cat on a sofa", "dog": "a dog on a beach", "ball": "a red ball on a table",
          "tree": "a green tree in a field"}


def write_data(root: Path) -> dict[str, str]:
    """The generated dataset folders: {token of MAPPING["paths"]: path}."""
    photos, clips, edits = root / "photos", root / "clips", root / "edits"
    write_edits(edits)
    for i, (stem, caption) in enumerate(PHOTOS.items()):
        write_image(photos / f"{stem}.png", (64, 64), seed=i, caption=caption)
        # Edit families' inputs (dataset.control_dir=control); captioned, so that the folder
        # is a dataset of 8 images for the others.
        write_image(photos / "control" / f"{stem}.png", (64, 64), seed=10 + i, caption=caption)
    for i, frames in enumerate((130, 40)):  # 130 frames fill MiniMax H3's 124-frame bucket
        write_video(clips / f"clip{i}.mp4", frames=frames, fps=24, size=(64, 64),
                    caption=f"a grey fade, clip {i}", tones=[(330 + 110 * i, 3.0), (880, 3.0)])
        write_image(clips / f"image{i}.png", (64, 64), seed=20 + i, caption="a coloured square")
    return {"@photos@": str(photos), "@clips@": str(clips), "@edits@": str(edits)}


# --- Running them ----------------------------------------------------------------------------

@dataclass
class Outcome:
    code: int
    out: str
    err: str
    cwd: Path  # the folder it ran in: its outputs/ and multirun/
    args: list[str] = field(default_factory=list)  # as run (the generated files' paths in)


class Runner:
    """Runs each process once, in a folder of its own, and keeps what came of it."""

    def __init__(self, root: Path):
        self.root = root
        self.files = write_data(root / "data")
        self.outcomes: dict = {}  # by index, and by run config

    def outcome(self, index: int) -> Outcome:
        """What came of process `index`, run now if not yet (or what came of an earlier
        process that composes the same run)."""
        if index not in self.outcomes:
            mapped = PROCESSES[index]
            run = _same_run(mapped.program, list(mapped.args))
            if run is None:
                self.outcomes[index] = self._run(index)
            else:
                if run not in self.outcomes:
                    self.outcomes[run] = self._run(index)
                self.outcomes[index] = self.outcomes[run]
        return self.outcomes[index]

    def first_run(self) -> Path:
        """The run dir of README's first training run (made now if not yet: the first point
        of the sweep it shares with the family pages' LoRA lines is its model)."""
        index = next(i for i, p in enumerate(PROCESSES) if FIRST_RUN in p.wheres)
        done = self.outcome(index)
        check_train(PROCESSES[index], done)
        return run_dirs(PROCESSES[index], done)[0]

    def exports_run(self) -> Path:
        """A run dir with step exports (`outputs/my_exports_run`), made now if not yet."""
        cwd = self.root / "exports_run"
        if not cwd.exists():
            cwd.mkdir()
            done = dpipe_train("model=tiny_flux", "train.max_steps=3",
                               "train.export_every_steps=1", "train.progress_bar=false",
                               cwd=cwd, timeout=TIMEOUT)
            assert done.code == 0, done.err[-4000:]
        return next(cwd.glob("outputs/*/run.yaml")).parent

    def user_files(self) -> Path:
        """What docs/lora-files.md assumes a user has (made now if not yet)."""
        files = self.root / "files"
        if not files.exists():
            write_flux_files(files / "models", files / "loras", files / "my_full_run")
        return files

    def _run(self, index: int) -> Outcome:
        mapped = PROCESSES[index]
        files = dict(self.files)
        if any("@run@" in a or "@lora@" in a for a in mapped.args):
            run = self.first_run()
            files.update({"@run@": str(run),
                          "@lora@": str(run / "lora" / "pytorch_lora_weights.safetensors")})
        if any("@files@" in a for a in mapped.args):
            files["@files@"] = str(self.user_files())
        if any("@exports_run@" in a for a in mapped.args):
            files["@exports_run@"] = str(self.exports_run())
        for earlier in _inputs_made_by(index):  # e.g. a `dpipe-lora convert`'s out= folder
            self.outcome(earlier)
        args = list(mapped.args)
        for token, path in files.items():
            args = [a.replace(token, path) for a in args]
        cwd = self.root / f"{index:02d}"
        cwd.mkdir()
        if not as_typed(mapped):  # the console script's main(), in this process
            done = dpipe_command(mapped.program, *args, cwd=cwd, timeout=TIMEOUT)
            return Outcome(done.code, done.out, done.err, cwd, args)
        module = "dpipe.cli." + mapped.program.removeprefix("dpipe-")
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return Outcome(-signal.SIGKILL, out, err + f"\ntimed out after {TIMEOUT} s", cwd, args)
        return Outcome(proc.returncode, out, err, cwd, args)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))


def _outputs(mapped: Mapped) -> list[str]:
    return [a.partition("=")[2] for a in mapped.args if a.startswith("out=")]


def _inputs_made_by(index: int) -> list[int]:
    """The earlier processes whose `out=` this one reads (a path of it under theirs)."""
    reads = [a.partition("=")[2] for a in PROCESSES[index].args
             if "=" in a and not a.startswith("out=")]
    return [i for i in range(index) if any(
        value.startswith(made) for made in _outputs(PROCESSES[i]) for value in reads)]


def _failed(mapped: Mapped, done: Outcome, why: str) -> str:
    return (f"{', '.join(mapped.wheres)}: documented command failed here as `{mapped}` "
            f"(in {done.cwd}): {why}\n--- stdout (end)\n{done.out[-3000:]}\n"
            f"--- stderr (end)\n{done.err[-6000:]}")


def _log_end(run_dir: Path) -> str:
    log = run_dir / "train.log"
    return log.read_text(errors="replace")[-4000:] if log.is_file() else "(no train.log)"


def run_dirs(mapped: Mapped, done: Outcome) -> list[Path]:
    """The run dirs a dpipe-train process made, in its points' order."""
    if _sweeps(mapped.args):
        summaries = sorted(done.cwd.glob("multirun/*/*/sweep_summary.json"))
        assert len(summaries) == 1, _failed(mapped, done, f"exit status {done.code}, sweep "
                                            f"summaries: {summaries}")
        points = json.loads(summaries[0].read_text())["points"]
        bad = [p for p in points if p["status"] != "completed"]
        assert not bad, _failed(mapped, done, "points that did not complete:\n" + "\n".join(
            f"{p['overrides']}: {p['status']}: {p['message']}\n{_log_end(Path(p['run_dir']))}"
            for p in bad))
        return [Path(p["run_dir"]) for p in points]
    return sorted(p.parent for p in done.cwd.glob("outputs/*/run.yaml"))


def check_train(mapped: Mapped, done: Outcome) -> None:
    if "--plan" in mapped.args:  # prints the plan, starts no worker
        assert done.code == 0, _failed(mapped, done, f"exit status {done.code}")
        assert re.search(r"^  keys: ", done.out, re.M), _failed(mapped, done, "no keys: line")
        assert not list(done.cwd.glob("outputs/*/metrics.jsonl")), _failed(
            mapped, done, "--plan trained")
        return
    if "--cfg" in mapped.args:  # prints the config, resolved, and runs nothing
        assert done.code == 0, _failed(mapped, done, f"exit status {done.code}")
        assert re.search(r"^name: \S+$", done.out, re.M), _failed(mapped, done, "no name: line")
        return
    dirs = run_dirs(mapped, done)  # a sweep's failed points first, with their logs
    assert done.code == 0, _failed(mapped, done, f"exit status {done.code}")
    assert dirs, _failed(mapped, done, "no run dir")
    for run_dir in dirs:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert any(r.get("step", 0) >= 1 for r in rows), _failed(
            mapped, done, f"{run_dir} trained no step")


def check_sample(mapped: Mapped, done: Outcome, run: Path) -> None:
    assert done.code == 0, _failed(mapped, done, f"exit status {done.code}")
    made = [p for folder in (done.cwd, run / "samples") for p in folder.rglob("*")
            if p.suffix in (".png", ".mp4")]
    assert made, _failed(mapped, done, "no sample written")


def check_export(mapped: Mapped, done: Outcome, run: Path) -> None:
    assert done.code == 0, _failed(mapped, done, f"exit status {done.code}")
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file(), _failed(
        mapped, done, "no LoRA file")


def check_bench(mapped: Mapped, done: Outcome) -> None:
    assert done.code == 0, _failed(mapped, done, f"exit status {done.code}")
    rows = json.loads((done.cwd / "outputs" / "bench" / "results.json").read_text())
    errors = [r for r in rows if "error" in r]
    assert not errors, _failed(mapped, done, f"runs that failed: {errors}")


def check_lora(mapped: Mapped, done: Outcome) -> None:
    assert done.code == 0, _failed(mapped, done, f"exit status {done.code}")
    out = [Path(done.cwd, a.partition("=")[2]) for a in done.args if a.startswith("out=")]
    assert out and all(p.exists() for p in out), _failed(mapped, done, f"no {out}")


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Runner:
    return Runner(tmp_path_factory.mktemp("documented"))


RUN_HERE = [i for i, p in enumerate(PROCESSES) if str(p) not in RUN_BY_TESTS]
LOCAL = [i for i in RUN_HERE if not PROCESSES[i].slurm]
ON_SLURM = [i for i in RUN_HERE if PROCESSES[i].slurm]


# The commands that run as a user types them, a process of the console script: README's first
# dpipe-train line (its LoRA line, a sweep with the family pages' LoRA lines) and the SLURM lines
# (their jobs are processes anyway). The rest call the console script's main() with the same arguments in this process
# (tests/cli.py): the same code from the arguments on, without each process's ~10 s of CPU
# importing torch, DeepSpeed, diffusers and Hydra twice (the launcher and its fork server).
# The shell's part is checked here and by tests/integration/test_quick_start.py (`make demo`).
FIRST_TRAIN_LINE = next(c.where for c, program, args in documented()
                        if c.where.startswith("README.md") and program == "dpipe-train")


def as_typed(mapped: Mapped) -> bool:
    return mapped.slurm or FIRST_TRAIN_LINE in mapped.wheres


def _id(index: int) -> str:
    p = PROCESSES[index]
    return p.wheres[0] + (f"+{len(p.wheres) - 1}" if len(p.wheres) > 1 else "")


def _check(mapped: Mapped, done: Outcome, runner: Runner) -> None:
    if mapped.program == "dpipe-train":
        check_train(mapped, done)
    elif mapped.program == "dpipe-sample":
        check_sample(mapped, done, runner.first_run())
    elif mapped.program == "dpipe-export":
        check_export(mapped, done, runner.first_run())
    elif mapped.program == "dpipe-bench":
        check_bench(mapped, done)
    elif mapped.program == "dpipe-lora":
        check_lora(mapped, done)
    else:  # dpipe-cache: build, show and prune (a dry run) on the mapped dataset
        assert done.code == 0, _failed(mapped, done, f"exit status {done.code}")


def part(index: int) -> str:
    """The half of this module a process runs in: tests/conftest.py gives each half a test
    worker of its own (GROUP_BY_PARAMS), so the two halves (~10 minutes of CPU together) run at
    once. The family pages' own lines are one half; every process that README's first run
    stands in, or that reads what another made, is in the other with it."""
    return "family pages" if all(w.startswith("docs/models/") for w in PROCESSES[index].wheres) \
        else "guides"


GROUP_BY_PARAMS = ("half",)


@pytest.mark.parametrize("half,index", [(part(i), i) for i in LOCAL],
                         ids=[_id(i) for i in LOCAL])
def test_documented_command_runs(half, index, runner):
    _check(PROCESSES[index], runner.outcome(index), runner)


@pytest.mark.slurm
@pytest.mark.parametrize("index", ON_SLURM, ids=[_id(i) for i in ON_SLURM])
def test_documented_slurm_command_runs(index, runner, slurm):
    check_train(PROCESSES[index], runner.outcome(index))


def test_every_documented_command_is_run():
    """Each documented command is in a process above (run here or by the test RUN_BY_TESTS
    names, which takes it from `documented_command`), or a `make` line run elsewhere (why)."""
    run = {w for p in PROCESSES for w in p.wheres}
    made = {line.split(": make")[0] for line in MAKE_ELSEWHERE}
    assert {c.where for c in COMMANDS} <= run | made
    assert not [line for line in MAKE_ELSEWHERE if line.endswith("NOT MAPPED")], (
        "a documented make target that MAPPING['make'] does not name")
    printed = {str(p) for p in PROCESSES}
    assert [p for p in PROCESSES if as_typed(p) and not p.slurm], "no command runs as typed"
    for command, test in RUN_BY_TESTS.items():
        assert command in printed, f"RUN_BY_TESTS: no documented command maps to `{command}`"
        path, name = test.split("::")
        source = (REPO / path).read_text()
        assert f"def {name}(" in source, f"RUN_BY_TESTS: no test {test}"
        assert "documented_command(" in source and f'"{command}"' in source, (
            f"{path} does not take `{command}` from documented_command")

if __name__ == "__main__":  # python -m tests.integration.test_documented_commands: the list
    for process in PROCESSES:
        by = RUN_BY_TESTS.get(str(process))
        print(f"{', '.join(process.wheres)}\n    -> {process}" + (f"\n    run by {by}" if by else ""))
    print(*MAKE_ELSEWHERE, sep="\n")
