"""Every command the docs show works as written.

The commands are read from README.md, docs/*.md and docs/models/*.md: each line of a fenced code
block (backslash continuations joined, `NAME="..."` assignments of the file expanded) and each
inline code span that starts with `dpipe-train`, `dpipe-sample`, `dpipe-cache`, `dpipe-bench`,
`dpipe-export`, `dpipe-lora` (also as `.venv/bin/dpipe-...` or `python -m dpipe.cli.<name>`) or
`make`. A lone `...` stands for "the overrides shown before" and is dropped; any other
placeholder (`<overrides>`, `[export=...]`) fails, so the docs keep to commands a user can paste.

How each is checked, in-process (a few seconds for all):
- `dpipe-train`: its arguments go through its own options (`--plan`, `--machine`) and then
  Hydra's own argument parser (`-m`, `--cfg job`, ...),
  each point of a sweep is composed from conf/ and validated by `dpipe.config.checks.validate`,
  the function `dpipe-train` calls first. That is every check before the filesystem's: an unknown
  key, a misspelt option, a wrong type, a value out of range, a missing `model.path`, stages
  against data parallel. The filesystem checks that follow (`spec.ensure_available`, the
  dataset folders, the run dir) are left out: the docs name weights such as /models/FLUX.1-dev
  that are not on a CI machine. A `--cfg job` command prints the config without validating it,
  so it is only composed, as Hydra does.
- `dpipe-cache` and `dpipe-bench`: their own argument parsers (`arg_parser()`), then the
  overrides validated as the command does (`dpipe.cli.cache.compose`; each `--run` composed on
  dpipe-bench's defaults with `compose_run`).
- `dpipe-sample`: key=value arguments, split as the command splits them (its SPECIAL keys); the
  rest composed and validated as for `dpipe-train` (with `run=`, over the default config, which
  stands for the run's own).
- `dpipe-lora`: its command and key=value arguments, split as the command splits them
  (`parse_arguments`: the keys each command takes, none missing); model= and model.* composed
  and validated as for `dpipe-train`.
- `make X`: X is a target of the Makefile. The quick start's `make demo` is run for real by
  tests/integration/test_quick_start.py.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = ("dpipe-train", "dpipe-sample", "dpipe-cache", "dpipe-bench", "dpipe-export",
            "dpipe-lora")
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")  # fenced blocks whose lines are commands
FENCE = re.compile(r"^[ \t]*```[ \t]*(\w*)[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # a span may wrap onto the next line
ASSIGNMENT = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")


@dataclass(frozen=True)
class Command:
    where: str  # file:line, for the failure message and the test id
    argv: tuple[str, ...]


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "docs" / "models").glob("*.md"))]


def program_of(argv: list[str]) -> tuple[str, list[str]] | None:
    """(program, its arguments) if `argv` runs one of the documented programs."""
    if not argv:
        return None
    name = Path(argv[0]).name
    if name in PROGRAMS or name == "make":
        return name, argv[1:]
    if name.startswith("python") and argv[1:2] == ["-m"] and len(argv) > 2 \
            and argv[2].startswith("dpipe.cli."):
        return "dpipe-" + argv[2].removeprefix("dpipe.cli."), argv[3:]
    return None


def _split(text: str, variables: dict[str, str]) -> list[str]:
    for name, value in variables.items():
        text = text.replace("${" + name + "}", value).replace("$" + name, value)
    return shlex.split(text.removeprefix("$ "), comments=True)


def commands_in(text: str, name: str) -> list[Command]:
    """The commands of one markdown text (see the module docstring)."""
    found = []
    variables: dict[str, str] = {}  # a file's later blocks use the variables of its earlier ones
    for block in FENCE.finditer(text):
        if block.group(1).lower() not in SHELL_BLOCKS:
            continue
        first = text.count("\n", 0, block.start(2)) + 1
        lines = block.group(2).splitlines()
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
            assignment = ASSIGNMENT.match(line.strip())
            if assignment:
                variables[assignment.group(1)] = _split(assignment.group(2), {})[0]
                continue
            if program_of(line.strip().removeprefix("$ ").split()[:3]):  # other lines: output
                found.append(Command(f"{name}:{first + start}",
                                     tuple(_split(line.strip(), variables))))
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # keeps the line numbers
    for span in INLINE.finditer(prose):
        code = " ".join(span.group(1).split())
        try:
            argv = shlex.split(code)
        except ValueError:  # not shell: an unbalanced quote in a Python or YAML snippet
            continue
        program = program_of(argv)
        if program and program[1]:  # a bare program name is a mention, not a command
            line = prose.count("\n", 0, span.start()) + 1
            found.append(Command(f"{name}:{line}", tuple(argv)))
    return found


def documented_commands() -> list[Command]:
    return [c for path in doc_files()
            for c in commands_in(path.read_text(), str(path.relative_to(REPO)))]


# --- the checks ------------------------------------------------------------------------------

def _overrides(args: list[str]) -> list[str]:
    """The arguments without the lone `...` placeholder; any other placeholder fails."""
    args = [a for a in args if a != "..."]
    for arg in args:
        if arg.startswith(("<", "[")) or "..." in arg:
            raise AssertionError(f"{arg!r} is a placeholder: write a command a user can paste")
    return args


def _validate_points(overrides: list[str], validate: bool = True) -> int:
    """Composes (and validates) every point of a (possibly swept) override list; the count."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dpipe.config.compose import compose_config, compose_run
    from dpipe.launch.sweep import register_launchers

    register_launchers()  # cluster=... presets name dpipe's launchers
    parsed = OverridesParser.create().parse_overrides(overrides)
    points = [p for batch in BasicSweeper.split_arguments(parsed, None) for p in batch]
    for point in points:
        compose_run(point) if validate else compose_config(point)
    return len(points)


def check_train(args: list[str]) -> None:
    from hydra._internal.utils import get_args_parser

    from dpipe.cli.train_plan import take_plan_options

    # dpipe-train's own options (`--plan`, `--machine`, parsed) come off before Hydra's parser.
    args, _ = take_plan_options(_overrides(args))
    parsed = get_args_parser().parse_args(args)
    _validate_points(parsed.overrides, validate=parsed.cfg is None)


def check_sample(args: list[str]) -> None:
    from dpipe.cli.sample import SPECIAL

    overrides = []
    for arg in _overrides(args):
        key, eq, _ = arg.partition("=")
        assert eq, f"{arg!r}: dpipe-sample takes key=value arguments"
        if key not in SPECIAL:
            overrides.append(arg)
    if not any(o.startswith("pipeline.stages=") for o in overrides):
        overrides.append("pipeline.stages=1")  # dpipe-sample's default
    _validate_points(overrides + ["name=samples"])


def check_cache(args: list[str]) -> None:
    from dpipe.cli.cache import arg_parser, compose

    compose(arg_parser().parse_intermixed_args(_overrides(args)).overrides)


def check_bench(args: list[str]) -> None:
    from dpipe.bench.overrides import bench_overrides
    from dpipe.cli.bench import arg_parser
    from dpipe.config.compose import compose_run

    for run in arg_parser().parse_args(_overrides(args)).run:
        name, colon, overrides = run.partition(":")
        assert colon and name.strip(), f"--run {run!r}: give NAME: OVERRIDES"
        compose_run(bench_overrides(overrides.split()))


def check_export(args: list[str]) -> None:
    from dpipe.cli.export import KEYS

    given = dict(arg.partition("=")[::2] for arg in _overrides(args))
    assert set(given) <= set(KEYS) and "run" in given, f"dpipe-export {args}: keys {KEYS}"


def check_lora(args: list[str]) -> None:
    from dpipe.cli.lora import COMMANDS, parse_arguments

    args = _overrides(args)
    assert args and args[0] in COMMANDS, f"dpipe-lora {args}: commands {COMMANDS}"
    _, overrides = parse_arguments(args[0], args[1:])
    if overrides:
        _validate_points(overrides)


def check_make(args: list[str]) -> None:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    for target in args:
        assert target in targets, f"make {target}: no such Makefile target ({sorted(targets)})"


CHECKS = {"dpipe-train": check_train, "dpipe-sample": check_sample, "dpipe-cache": check_cache,
          "dpipe-bench": check_bench, "dpipe-export": check_export, "dpipe-lora": check_lora,
          "make": check_make}


def check(command: Command) -> None:
    program, args = program_of(list(command.argv))
    CHECKS[program](args)


COMMANDS = documented_commands()


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
@pytest.mark.slow
def test_documented_command_works(command):
    check(command)


def test_the_docs_commands_are_found():
    """The extractor finds the commands a reader sees (so a broken parser cannot pass by
    finding none): the quick start, the README's real-model command, a family page's."""
    where = {c.argv[:2] for c in COMMANDS}
    assert ("make", "demo") in where and ("make", "test") in where
    readme = [c for c in COMMANDS
              if c.where.startswith("README.md") and c.argv[0].endswith("dpipe-train")]
    assert any("model=flux" in c.argv for c in readme)
    pages = {c.where.split(":")[0] for c in COMMANDS if c.where.startswith("docs/models/")}
    assert len(pages) == len(list((REPO / "docs" / "models").glob("*.md")))


BAD = """\
Train it:

```bash
dpipe-train model=flux model.path=/models/FLUX.1-dev \\
    dataset=folder dataset.path=/data/photos dataset.resolution=1024
```

Or `dpipe-train model=flux pipeline.stages=4` (no weights), `dpipe-cache biuld model=tiny_flux`,
`dpipe-sample run=outputs/my_run [export=step_1500]`, `make dmeo`, and
`python -m dpipe.cli.bench --run "lora: pipeline=single model.lora.rank=0"`.
"""


def test_a_broken_command_in_a_doc_fails():
    """Each broken command of BAD is found, at its line, and fails its check."""
    found = commands_in(BAD, "BAD.md")
    lines = [int(c.where.split(":")[1]) for c in found]
    assert lines == [4, 8, 8, 9, 9, 10]
    from hydra.errors import HydraException

    from dpipe.errors import UserError

    for command in found:
        # dpipe's config errors, Hydra's, argparse's exit, or this module's placeholder check.
        with pytest.raises((UserError, HydraException, SystemExit, AssertionError)):
            check(command)


def test_a_good_snippet_passes():
    text = ('```bash\nL="model.lora.rank=16 optim.lr=1e-4"\ndpipe-train -m $L train.max_steps=2,4 '
            '# a sweep\n```\nand `.venv/bin/dpipe-cache show model=tiny_flux`.')
    found = commands_in(text, "GOOD.md")
    assert [c.argv[0] for c in found] == ["dpipe-train", ".venv/bin/dpipe-cache"]
    assert "model.lora.rank=16" in found[0].argv and "#" not in found[0].argv
    for command in found:
        check(command)


def test_every_model_config_is_documented():
    """Each conf/model option a user picks (the real ones) appears in a `model=` command of a
    family page, and each family in the registry has a page that the index links."""
    from dpipe.models.registry import FAMILIES

    index = (REPO / "docs" / "models.md").read_text()
    pages = {p.stem: p for p in (REPO / "docs" / "models").glob("*.md")}
    for family in FAMILIES:
        assert family in pages, f"docs/models/{family}.md is missing"
        assert f"(models/{family}.md)" in index, f"docs/models.md does not link {family}.md"
    used = {a.removeprefix("model=") for c in COMMANDS if c.where.startswith("docs/models/")
            for a in c.argv if a.startswith("model=")}
    options = {p.stem for p in (REPO / "conf" / "model").glob("*.yaml")
               if not p.stem.startswith("tiny_")}
    assert options <= used, f"no family page runs model={sorted(options - used)}"
