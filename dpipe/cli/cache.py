"""`dpipe-cache`: fill, inspect, verify and prune the latent/text cache of a run config.

    dpipe-cache build dataset=folder dataset.path=/data/photos model=flux model.path=/m/FLUX.1-dev
    dpipe-cache show  dataset=folder dataset.path=/data/photos ...   # what the cache holds
    dpipe-cache prune dataset=folder dataset.path=/data/photos ...   # what no dataset uses
    dpipe-cache prune --delete --keep-run outputs/my-run ...           # ... and delete it
    dpipe-cache verify dataset.cache_dir=/scratch/dpipe-cache        # checksum every entry
    dpipe-cache verify --remove ...                                  # ... remove damaged ones

The overrides are those of `dpipe-train` (same config files), so `build` makes exactly the entries
that training with the same overrides will look for; training then starts without encoding.
`build` uses every visible GPU (one process each) or, without a GPU, this CPU, with worker
processes decoding files. It can be stopped at any time: the next run continues where it stopped.
For a large dataset, build the cache before training: ranks waiting for the others' share of a
long first fill inside training are subject to the process group's collective timeout.

`verify` reads every entry of the cache (whatever dataset made it) and checks it against the
checksum it was written with; it exits with status 1 if it finds damaged entries and does not
remove them. A removed entry is made again by the next run that uses it (a run re-makes a damaged
entry it meets by itself, too). Entries written before entries carried checksums are counted
apart: they can only be read as they are.

`prune` removes entries that the composed config's datasets (training and eval sets) do not use.
A cache shared by several datasets needs them all: prune with each config's dry run first, or
keep the runs whose interrupted epochs still need older entries with `--keep-run RUN_DIR`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

log = logging.getLogger("dpipe")
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
STALE_TEMP_SECONDS = 3600  # temp files of writers killed this long ago are removed by prune


def compose(overrides: list[str]):
    """The validated RunConfig for `dpipe-train`-style overrides."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from dpipe.config.checks import validate
    from dpipe.config.experiments import preset_overrides
    from dpipe.config.store import register_schemas

    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose("config", overrides=preset_overrides(overrides),
                            return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # `name` interpolates Hydra's runtime choices
    return validate(cfg)


def _dtype(run, cuda: bool):
    import torch

    from dpipe.config.schema import Precision

    # The rule training uses (dpipe.train.loop): the cache key includes the encoder dtype.
    return torch.bfloat16 if run.train.precision == Precision.bf16 and cuda else torch.float32


def build(run, gpus: int) -> None:
    from dpipe.models.registry import build_spec

    build_spec(run.model).ensure_available()
    if gpus > 1:
        import torch.multiprocessing as mp

        from dpipe.launch.local import hosted_store

        with hosted_store() as port:
            mp.spawn(_build_rank, args=(gpus, port, run), nprocs=gpus, join=True)
    else:
        _build_rank(0, 1, None, run)


def _build_rank(rank: int, world: int, port: int | None, run) -> None:
    import torch
    import torch.distributed as dist

    from dpipe.data.prepare import Layout, prepare
    from dpipe.models.registry import build_spec

    _logging(rank)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    if world > 1:
        from dpipe.launch.local import WORKERS_USE_HOSTED_STORE

        os.environ.update(WORKERS_USE_HOSTED_STORE, LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=timedelta(hours=24),
                                device_id=torch.device("cuda", rank) if cuda else None)
    spec = build_spec(run.model)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    start = time.perf_counter()
    dataset = prepare(spec, run.dataset, device, _dtype(run, cuda),
                      Layout.of(run, max(1, world // run.pipeline.stages)), make_plan=False)
    if rank == 0:
        s = dataset.stats
        made = s["latents"] + s["masks"] + s["texts"] + s["audio"]
        # Two different reads: the file index opens new or changed files for their size (none on
        # a rerun), and each latent or mask made decodes one file; "0 read" after encoding new
        # images would look like nothing happened.
        sound = f", {s['audio']} audio" if s["audio"] else ""  # audio-video models' sound
        log.info("cache ready in %.1f s: %d entries, %d made now (%d latents, %d masks, "
                 "%d texts%s); %d file(s) decoded to encode, %d new or changed file(s) indexed, %d unreadable",
                 time.perf_counter() - start, s["entries"], made, s["latents"], s["masks"],
                 s["texts"], sound, s["latents"] + s["masks"] + s["audio"], s["files_read"],
                 s["failed"])
    if world > 1:
        dist.destroy_process_group()


def show(run) -> None:
    import torch

    from dpipe.data.cache_store import TensorStore
    from dpipe.data.prepare import needed_entries
    from dpipe.models.registry import build_spec

    store = TensorStore(Path(run.dataset.cache_dir).expanduser())
    keys = store.keys()
    kinds: Counter = Counter()
    sizes: Counter = Counter()
    for key in keys:
        try:
            kind = store.metadata(key).get("kind", "unknown")
        except Exception:  # unreadable header: prune removes it with the other unused entries
            kind = "unreadable"
        kinds[kind] += 1
        sizes[kind] += store.path_for(key).stat().st_size
    print(f"cache {store.root}: {len(keys)} entries, {_size(sum(sizes.values()))}")
    for kind in sorted(kinds):
        print(f"  {kind:<10} {kinds[kind]:>9}  {_size(sizes[kind]):>10}")
    spec = build_spec(run.model)
    spec.ensure_available()
    needed, missing = needed_entries(spec, run.dataset, _dtype(run, torch.cuda.is_available()))
    print(f"this config's datasets use {len(needed)} entries: {len(needed) - missing} cached, "
          f"{missing} missing (dpipe-cache build makes them)")
    print(f"{len(keys - needed)} entries are not used by this config (dpipe-cache prune)")


def prune(run, delete: bool, keep_runs: list[str]) -> None:
    import torch

    from dpipe.data.cache_store import TensorStore
    from dpipe.data.plan import load_history
    from dpipe.data.prepare import DATA_DIR, needed_entries
    from dpipe.models.registry import build_spec

    store = TensorStore(Path(run.dataset.cache_dir).expanduser())
    spec = build_spec(run.model)
    spec.ensure_available()
    needed, _ = needed_entries(spec, run.dataset, _dtype(run, torch.cuda.is_available()))
    for run_dir in keep_runs:
        _, manifests = load_history(Path(run_dir) / DATA_DIR)
        if not manifests:
            print(f"warning: {run_dir} has no data history ({DATA_DIR}/history.json)")
        for manifest in manifests.values():
            needed |= manifest.keys()
    unused = sorted(store.keys() - needed)
    total = sum(store.path_for(k).stat().st_size for k in unused)
    temps = [p for p in store.root.glob("??/.*.tmp")
             if time.time() - p.stat().st_mtime > STALE_TEMP_SECONDS]
    if not delete:
        print(f"{len(unused)} unused entries ({_size(total)}) and {len(temps)} stale temp files "
              f"in {store.root}; run again with --delete to remove them")
        return
    freed = sum(store.remove(k) for k in unused)
    for p in temps:
        p.unlink(missing_ok=True)
    print(f"removed {len(unused)} unused entries ({_size(freed)}) and {len(temps)} stale temp "
          f"files from {store.root}")


def verify(run, remove: bool) -> bool:
    """Checks every entry; True if no damaged entry is left."""
    from concurrent.futures import ThreadPoolExecutor

    from dpipe.data.cache_store import DamagedEntry, TensorStore

    store = TensorStore(Path(run.dataset.cache_dir).expanduser())
    keys = sorted(store.keys())
    start = time.perf_counter()

    def check(key: str):
        try:
            return store.verify(key)
        except DamagedEntry as damage:
            return damage

    # Threads: reading and zlib's CRC both release the GIL.
    with ThreadPoolExecutor(8, thread_name_prefix="cache-verify") as pool:
        results = dict(zip(keys, pool.map(check, keys)))
    damaged = {k: r for k, r in results.items() if isinstance(r, DamagedEntry)}
    unverified = sum(r is False for r in results.values())
    print(f"cache {store.root}: {len(keys)} entries read in {time.perf_counter() - start:.1f} s: "
          f"{sum(r is True for r in results.values())} match their checksum, {len(damaged)} "
          f"damaged" + (f", {unverified} have none (written before dpipe wrote checksums; "
                        "read as they are)" if unverified else ""))
    for key, damage in damaged.items():
        print(f"  {damage.path}{_made_from(store, key)}: {damage.reason}")
    if not damaged:
        return True
    if not remove:
        print("run again with --remove to remove them; the runs that use them make them again")
        return False
    for key in damaged:
        store.remove(key)
    print(f"removed {len(damaged)} damaged entries; the runs that use them make them again")
    return True


def _made_from(store, key: str) -> str:
    """" (latents of /data/a.png)" from the entry's header, where it can still be read."""
    try:
        meta = store.metadata(key)
    except Exception:  # the header is what is damaged
        return ""
    what = meta.get("source") or meta.get("clip") or (
        repr(meta["caption"][:60]) if "caption" in meta else None)
    return f" ({meta.get('kind', 'entry')} of {what})" if what else ""


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S",
                        force=True)


def arg_parser() -> argparse.ArgumentParser:
    """dpipe-cache's arguments; tests/unit/test_docs_commands.py checks the docs with it."""
    parser = argparse.ArgumentParser(
        prog="dpipe-cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "show", "verify", "prune"])
    parser.add_argument("--delete", action="store_true", help="prune: delete (default: dry run)")
    parser.add_argument("--remove", action="store_true",
                        help="verify: remove the damaged entries (default: list them)")
    parser.add_argument("--keep-run", action="append", default=[], metavar="RUN_DIR",
                        help="prune: also keep the entries this run's data history uses")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for dpipe-train")
    return parser


def main(argv: list[str] | None = None) -> int:
    from dpipe.errors import UserError
    from dpipe.launch.quiet import disable_library_progress_bars, quiet_libraries

    args = arg_parser().parse_intermixed_args(argv)  # flags may come after the overrides
    quiet_libraries()
    _logging(0)
    try:
        import torch

        disable_library_progress_bars()
        run = compose(args.overrides)
        if args.command == "build":
            build(run, torch.cuda.device_count())
        elif args.command == "show":
            show(run)
        elif args.command == "verify":
            return 0 if verify(run, args.remove) else 1
        else:
            prune(run, args.delete, args.keep_run)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
