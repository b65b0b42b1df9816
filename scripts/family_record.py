"""Records what every family's tiny model does end to end, to prove a refactor changed nothing.

    python scripts/family_record.py write record.json [tiny_flux tiny_wan ...]
    python scripts/family_record.py compare before.json after.json
    python scripts/family_record.py collect WORK_DIR record.json [tiny_flux ...]  # again, from
        the files a `write` left in WORK_DIR

Records of different families compare the runs of the families both hold.

`write` trains every tiny model (or those named) as sweeps of `dpipe-train -m`: a LoRA and a full
fine-tune each, 2 pipeline stages in 2 processes, fp32, 3 steps, the default seed, sampling
through the stages at the end with the latents saved. It records per run the loss of each step,
the sha256 of every exported file (diffusers, ComfyUI, single files and their metadata, relative
to the run's `lora/` or `model/`), of every saved sample latent, image and clip, the names of the
cache's entries (their keys) and the hashes of the tiny model folders' files (safetensors files
by their content, clips by their streams' frame counts and sizes: see `sha`). `compare` prints every
difference and exits 1 if there is one. Losses are compared bit for bit (their float repr).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpipe.models.tiny_stamp import STAMP  # noqa: E402
from tests.integration.test_families import (  # noqa: E402
    CAPTIONS, FAMILIES, SWEEP, _group, sample_args)

MODES = {"lora": ["train.max_steps=3"],
         "full": ["train.max_steps=3", "model.mode=full"]}
COMMON = [*SWEEP, "pipeline.stages=2", "train.precision=fp32"]


def sha(path: Path) -> str:
    """The file's sha256; for safetensors, of its content (metadata sorted, then each tensor's
    name, dtype, shape and bytes), since safetensors writes its header's metadata in an order
    that differs from process to process. An mp4 is recorded by its streams' frame counts and
    sizes: x264's output depends on the encoding process's thread count (two runs of the same
    code differ), and its frames are those of the sample's latents, which are recorded."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        digest = hashlib.sha256()
        with safe_open(path, "pt") as f:
            digest.update(json.dumps(f.metadata() or {}, sort_keys=True).encode())
            for key in sorted(f.keys()):
                t = f.get_tensor(key).contiguous()
                digest.update(f"{key} {t.dtype} {tuple(t.shape)}".encode())
                digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return "content:" + digest.hexdigest()
    if path.suffix == ".mp4":
        import av

        with av.open(str(path)) as container:
            streams = []
            for stream in container.streams:
                frames = [f for f in container.decode(stream)]
                shape = frames[0].to_ndarray().shape if frames else ()
                streams.append(f"{stream.type} {len(frames)} x {shape}")
        return "mp4: " + "; ".join(streams)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_hashes(root: Path) -> dict[str, str]:
    # A tiny model's stamp names the code that wrote it (dpipe.models.tiny_stamp), which a
    # refactor changes by definition: the files it stamps are what must stay equal.
    return {str(p.relative_to(root)): sha(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != STAMP}


def run_record(run_dir: Path) -> dict:
    losses = [repr(json.loads(line)["loss"])
              for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    samples = run_dir / "samples"
    last = max((p for p in samples.iterdir() if p.is_dir()),
               key=lambda p: int(p.name.split("_")[1])) if samples.is_dir() else None
    return {"losses": losses,
            "exports": {f"{folder}/{name}": digest for folder in ("lora", "model")
                        if (run_dir / folder).is_dir()
                        for name, digest in tree_hashes(run_dir / folder).items()},
            "samples": tree_hashes(last) if last else {}}


def write(out: Path, families: list[str]) -> None:
    work = Path(tempfile.mkdtemp(prefix="family-record-"))
    env = {**os.environ, "DPIPE_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1"}
    from dpipe.data.synthetic import draw_shape

    control = work / "control.png"
    draw_shape(3, 64)[0].save(control)
    # The dataset of test_families: its images, captioned in 1 to 9 words.
    captioned = work / "captioned"
    captioned.mkdir()
    for i, caption in enumerate(CAPTIONS):
        draw_shape(i, 64)[0].save(captioned / f"image{i}.png")
        (captioned / f"image{i}.txt").write_text(caption)
    for mode, args in MODES.items():
        groups: dict[str, list[str]] = {}
        for family in families:
            groups.setdefault(_group(family)[0], []).append(family)
        for key, members in groups.items():
            sweep_dir = work / mode / key
            cmd = [sys.executable, "-m", "dpipe.cli.train", "-m", f"hydra.sweep.dir={sweep_dir}",
                   f"model={','.join(members)}", *COMMON, *sample_args(key, control),
                   f"dataset.path={captioned}", *args]
            print(f"== {mode} {key}: {len(members)} families", flush=True)
            done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            summary = sweep_dir / "sweep_summary.json"
            points = json.loads(summary.read_text())["points"] if summary.is_file() else []
            if not points:
                for family in members:
                    print(f"   {mode}:{family}: FAILED {done.stderr[-300:]}", flush=True)
    record = collect(work, families)
    out.write_text(json.dumps(record, indent=1, sort_keys=True))
    print(f"{len(record['runs'])} runs recorded in {out}; {len(record['errors'])} failed; "
          f"work files in {work}")


def collect(work: Path, families: list[str]) -> dict:
    """The record of the sweeps that `write` ran in `work`."""
    record: dict = {"families": families, "runs": {}, "errors": {}}
    for mode in MODES:
        for key in {_group(family)[0] for family in families}:
            summary = work / mode / key / "sweep_summary.json"
            points = json.loads(summary.read_text())["points"] if summary.is_file() else []
            for family in (f for f in families if _group(f)[0] == key):
                point = [p for p in points if f"model={family}" in p["overrides"]]
                name = f"{mode}:{family}"
                if not point or point[0]["status"] != "completed":
                    record["errors"][name] = point[0]["message"] if point else "no sweep point"
                    continue
                record["runs"][name] = run_record(Path(point[0]["run_dir"]))
    cache = work / "cache"
    # The cache's latent and text entries are named by their keys; the tiny models are written
    # once under models/, from fixed seeds.
    # (sources/ holds the dataset folders' file indexes, named by the folder's path: not keys.)
    latents = cache / "latents"
    record["cache_entries"] = sorted(str(p.relative_to(cache)) for p in latents.rglob("*")
                                     if p.is_file() and p.parent.name != "sources")
    record["tiny_models"] = tree_hashes(cache / "models")
    return record


def compare(a_path: Path, b_path: Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    differences = []
    if set(a["families"]) != set(b["families"]):
        # Records of other families: compare the runs of the families both hold; the cache and
        # the tiny models are shared by all of a record's runs, so they are left out.
        common = set(a["families"]) & set(b["families"])
        print(f"comparing the {len(common)} families both records hold "
              "(cache entries and tiny models left out)")
        a, b = ({"runs": {k: v for k, v in r["runs"].items() if k.split(":")[1] in common},
                 "errors": {k: v for k, v in r["errors"].items() if k.split(":")[1] in common}}
                for r in (a, b))

    def diff(where: str, x, y):
        if isinstance(x, dict) and isinstance(y, dict):
            for key in sorted(set(x) | set(y)):
                if key not in x or key not in y:
                    side = "after" if key in y else "before"
                    differences.append(f"{where}/{key}: only in {side}")
                else:
                    diff(f"{where}/{key}", x[key], y[key])
        elif x != y:
            differences.append(f"{where}: {str(x)[:120]} != {str(y)[:120]}")

    diff("", a, b)
    runs = len(set(a["runs"]) & set(b["runs"]))
    files = sum(len(r["exports"]) + len(r["samples"]) for r in b["runs"].values())
    for line in differences:
        print(line)
    print(f"{runs} runs compared ({files} exported and sample files, "
          f"{len(b.get('cache_entries', []))} cache entries): "
          f"{len(differences)} differences")
    return 1 if differences else 0


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "write":
        families = sys.argv[3:] or FAMILIES
        unknown = sorted(set(families) - set(FAMILIES))
        if unknown:
            print(f"not a tiny family of tests/integration/test_families.py: {unknown}")
            return 2
        write(Path(sys.argv[2]), families)
        return 0
    if len(sys.argv) >= 4 and sys.argv[1] == "collect":
        families = sys.argv[4:] or FAMILIES
        record = collect(Path(sys.argv[2]), families)
        Path(sys.argv[3]).write_text(json.dumps(record, indent=1, sort_keys=True))
        print(f"{len(record['runs'])} runs recorded in {sys.argv[3]}")
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        return compare(Path(sys.argv[2]), Path(sys.argv[3]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
