"""`dpipe-export`: writes a run's export again from one of its checkpoints.

    dpipe-export run=outputs/my_run                     # from the newest checkpoint
    dpipe-export run=outputs/my_run checkpoint=step_500 # from the step-500 checkpoint

Writes every format of the family (LoRA: diffusers, ComfyUI, ...; full fine-tune: the diffusers
folder and the single-file layout it came in), and the EMA's (`ema/`) where the checkpoint
holds one, into the final export (`<run>/lora/` or `<run>/model/`) when the checkpoint is at
`train.max_steps`, else into `<run>/lora/step_<N>/`. Other exports stay. One process, no GPU,
no model weights loaded: the checkpoint's layer files name their diffusers parameters. It holds
the run dir's lock while it writes, so it never runs beside training on the same run.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from dpipe.errors import UserError

KEYS = ("run", "checkpoint")


def main() -> None:
    from dpipe.launch.quiet import quiet_libraries

    quiet_libraries()
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if args else 2)
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] %(message)s")
    try:
        out = export_command(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {out}")


def export_command(args: list[str]) -> Path:
    from dpipe.launch import run_lock
    from dpipe.train.reexport import reexport

    given = {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or key not in KEYS:
            raise UserError(f"{arg!r}: give run=<run dir> and optionally checkpoint=step_<N> "
                            "(dpipe-export --help)")
        given[key] = value
    if "run" not in given:
        raise UserError("give run=<run dir>, the folder dpipe-train wrote (e.g. outputs/<name>)")
    run_dir = Path(given["run"]).expanduser().resolve()
    if not run_dir.is_dir():
        raise UserError(f"run={given['run']}: no such folder")
    with run_lock.acquire(run_dir):
        return reexport(run_dir, given.get("checkpoint"))


if __name__ == "__main__":
    main()
