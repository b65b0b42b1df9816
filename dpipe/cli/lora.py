"""`dpipe-lora`: LoRA files outside training. One process; `device=cuda` computes on the GPU.

    dpipe-lora convert lora=<file> model=flux model.path=/models/FLUX.1-dev out=<folder>
    dpipe-lora merge base=<folder or file> lora=<file>[:<weight>] [lora=...] out=<folder or file>
    dpipe-lora extract base=<folder or file> tuned=<folder or file> rank=32 out=<file>
    dpipe-lora resize lora=<file> rank=8 out=<file>
    dpipe-lora ema run=<run dir> decay=0.999 out=<file>

convert: a LoRA in any format dpipe reads (diffusers, peft, ComfyUI, kohya, ai-toolkit/
musubi-tuner, LyCORIS) into every format the family writes, as a run's export (model= and
model.* as for dpipe-train). merge: LoRAs (each times its weight, default 1) added to a base's
weights, written in the base's layout (a quantized single file's, ComfyUI's 8-bit or GGUF, quantized
again in its own format); the LoRA's names are the base's, or give model= for another format's
names (diffusers-named LoRAs on a single file in the family's original names too). extract: a rank-r LoRA of the difference of two weights of one layout,
by SVD. resize: a LoRA at a lower rank, in its own format. ema: the post-hoc EMA of a run's step
exports (train.export_every_steps). extract and resize print the energy (squared singular
values) kept.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from dpipe.errors import ConfigError, UserError

COMMANDS = ("convert", "merge", "extract", "resize", "ema")
KEYS = {"convert": ("lora", "out"), "merge": ("base", "lora", "out"),
        "extract": ("base", "tuned", "rank", "out"), "resize": ("lora", "rank", "out"),
        "ema": ("run", "decay", "out")}
OPTIONAL = ("device",)


def main(argv: list[str] | None = None) -> None:
    from dpipe.launch.quiet import quiet_libraries

    quiet_libraries()
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if args else 2)
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] %(message)s")
    try:
        print(lora_command(args[0], args[1:]))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def parse_arguments(command: str, args: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """({key: values} of the command's keys, the model.* / model= overrides)."""
    given: dict[str, list[str]] = {}
    overrides = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq:
            raise UserError(f"{arg!r}: give key=value arguments (dpipe-lora --help)")
        if key in KEYS[command] or key in OPTIONAL:
            given.setdefault(key, []).append(value)
        elif command in ("convert", "merge") and (key == "model" or key.startswith("model.")):
            overrides.append(arg)
        else:
            raise UserError(f"{arg!r}: dpipe-lora {command} takes "
                            f"{', '.join(f'{k}=' for k in KEYS[command] + OPTIONAL)}"
                            f"{' and model=, model.*' if command in ('convert', 'merge') else ''}")
    missing = [k for k in KEYS[command] if k not in given]
    if missing:
        raise UserError(f"dpipe-lora {command}: give {', '.join(f'{k}=' for k in missing)} "
                        "(dpipe-lora --help)")
    for key, values in given.items():
        if len(values) > 1 and not (command == "merge" and key == "lora"):
            raise UserError(f"{key}= given {len(values)} times: give it once")
    return given, overrides


def _existing(value: str, key: str) -> Path:
    path = Path(value).expanduser()
    if not path.exists():
        raise UserError(f"{key}={value}: no such file or folder")
    return path


def _rank(value: str) -> int:
    try:
        rank = int(value)
    except ValueError:
        rank = 0
    if rank < 1:
        raise UserError(f"rank={value}: give a whole number of at least 1")
    return rank


def _spec(overrides: list[str]):
    """The family spec that model= and model.* compose (its tiny model written if tiny)."""
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec

    if not any(o.startswith("model=") for o in overrides):
        raise UserError("give model=<family> (and model.path=<its diffusers folder>), as for "
                        "dpipe-train: the family's names place the LoRA's modules")
    try:
        run = compose_run(overrides)
    except UserError:
        raise
    except Exception as err:  # Hydra's errors for an unknown preset or key
        raise ConfigError(str(err).replace("\n", " ")) from None
    spec = build_spec(run.model)
    spec.ensure_available()
    return spec


def _progress():
    from tqdm import tqdm

    return lambda items, **kw: tqdm(items, file=sys.stderr, disable=None, **kw)


def lora_command(command: str, args: list[str]) -> str:
    """Runs one command; returns the line that says what it wrote."""
    from dpipe.models import lora_tools

    if command not in COMMANDS:
        raise UserError(f"{command!r}: dpipe-lora's commands are {', '.join(COMMANDS)}")
    given, overrides = parse_arguments(command, args)
    one = {k: v[0] for k, v in given.items()}
    out = Path(one["out"]).expanduser()
    device, progress = one.get("device", "cpu"), _progress()
    if command == "convert":
        written = lora_tools.convert(_existing(one["lora"], "lora"), _spec(overrides), out,
                                     progress=progress)
        return f"wrote {', '.join(str(p) for p in written)}"
    if command == "merge":
        loras = []
        for value in given["lora"]:
            path, weight = value, 1.0
            head, colon, tail = value.rpartition(":")
            if colon and not Path(value).exists():
                try:
                    path, weight = head, float(tail)
                except ValueError:
                    raise UserError(f"lora={value}: give <file> or <file>:<weight>") from None
            loras.append((_existing(path, "lora"), weight))
        names, family = None, "the base"
        if overrides:
            from dpipe.models.lora_names import base_names

            spec = _spec(overrides)
            base = _existing(one["base"], "base")
            names = base_names(spec, lora_tools.weight_shapes(lora_tools.weight_files(base)))
            family = spec.cfg.family
        written = lora_tools.merge(_existing(one["base"], "base"), loras, out, names=names,
                                   family=family, device=device, progress=progress)
        return f"merged {len(loras)} LoRA(s) into {written}"
    if command == "extract":
        energy = lora_tools.extract(_existing(one["base"], "base"),
                                    _existing(one["tuned"], "tuned"), _rank(one["rank"]), out,
                                    device=device, progress=progress)
        return f"wrote {out}; {energy.line()}"
    if command == "resize":
        energy = lora_tools.resize(_existing(one["lora"], "lora"), _rank(one["rank"]), out,
                                   device=device, progress=progress)
        return f"wrote {out}; {energy.line()}"
    try:
        decay = float(one["decay"])
    except ValueError:
        raise UserError(f"decay={one['decay']}: give a number between 0 and 1") from None
    steps = lora_tools.ema(_existing(one["run"], "run"), decay, out, progress=progress)
    return f"wrote {out}: EMA (decay {decay} per step) of the exports at steps {steps}"


if __name__ == "__main__":
    main()
