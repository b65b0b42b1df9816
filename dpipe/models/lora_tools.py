"""What `dpipe-lora` does: merge LoRAs into a base, extract a LoRA from a fine-tune, resize a
LoRA to a lower rank, convert one into every format a family writes, and average a run's step
exports (post-hoc EMA). One process, CPU or GPU (`device`), every file written atomically.

A base is a diffusers folder (the model's, or its denoiser's: the `.safetensors` files in it)
or a single file (plain, one of ComfyUI's 8-bit quantized layouts, or a GGUF, which merge writes
back in its layout); its module names are its weights' keys without `.weight` (and without a
single file's `model.diffusion_model.` / `diffusion_model.` prefix). A LoRA is read by
`dpipe.models.lora_read`, placed by the base's own names, or by a family's (`names`) where
its names are another format's (`lora_names.base_names`: on a single file in the family's
original names, through the family's `to_original` converter).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dpipe.config.schema import Adapter
from dpipe.errors import UserError
from dpipe.io import atomic_write, replace_dir
from dpipe.models.lora_names import LoraNames, split_key
from dpipe.models.lora_read import LoraLayoutError, read_lora
from dpipe.models.single_file import FILE_PREFIXES

Progress = Callable  # an iterable wrapper: tqdm, or `lambda items, **_: items`


def quiet(items, **_):
    return items


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a base: the file itself, a denoiser folder's, or a model
    folder's denoiser's (`transformer/` or `unet/`)."""
    if path.is_file():
        return [path]
    for folder in (path, path / "transformer", path / "unet"):
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if files:
            return files
    raise UserError(f"{path}: no .safetensors weights there (give a diffusers folder, its "
                    "transformer/ or unet/ folder, or a single .safetensors file)")


def module_name(key: str) -> str | None:
    """The module a weight key belongs to, None for other keys."""
    if not key.endswith(".weight"):
        return None
    for prefix in FILE_PREFIXES:
        key = key.removeprefix(prefix)
    return key.removesuffix(".weight")


def weight_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """{module: weight shape} of every matrix and convolution kernel in `files` (LoCon's conv
    LoRAs merge into the kernels), from their headers (a GGUF's tensor infos)."""
    from safetensors import safe_open

    from dpipe.models.common.gguf_files import GGUF_SUFFIX

    shapes = {}
    for file in files:
        if file.suffix == GGUF_SUFFIX:
            from gguf import GGUFReader

            found = {t.name: tuple(int(n) for n in reversed(t.shape.tolist()))
                     for t in GGUFReader(str(file)).tensors}
        else:
            with safe_open(str(file), "pt") as f:
                found = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        for key, shape in found.items():
            module = module_name(key)
            if module is not None and len(shape) >= 2:
                shapes[module] = shape
    return shapes


def refuse_quantized(files: list[Path]) -> None:
    """extract subtracts weights: a quantized file's (8-bit values with their scales, GGUF
    blocks) are refused."""
    from dpipe.models.common.gguf_files import GGUF_SUFFIX
    from dpipe.models.common.quantized_files import file_is_quantized

    for file in files:
        if file.suffix == GGUF_SUFFIX or file_is_quantized(file):
            raise UserError(f"{file}: a quantized file: dpipe-lora extracts from bf16, fp16 or "
                            "fp32 weights (merge writes into quantized files)")


def save_atomically(tensors: dict[str, torch.Tensor], path: Path,
                    metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _read(lora: Path, names: LoraNames, family: str):
    try:
        read = read_lora(lora, names, family)
    except LoraLayoutError as err:
        raise UserError(f"{lora}: {err}") from None
    if read.kind == Adapter.dora:
        raise UserError(f"{lora}: a DoRA, whose merged weight depends on the base's norms: "
                        "train on it with model.merge_adapters=[...] (peft merges it)")
    return read


def merge(base: Path, loras: list[tuple[Path, float]], out: Path, names: LoraNames | None = None,
          family: str = "the base", device: str = "cpu", progress: Progress = quiet) -> Path:
    """The base with each LoRA's delta times its weight added (W += w * scale * B @ A, in fp32),
    written in the base's layout at `out` (a file for a single file, else a folder with the
    base's other files): each weight in its dtype, or requantized in a quantized file's own
    layout (`dpipe.models.common.stored_weights`). Returns `out`."""
    from dpipe.models.common.stored_weights import open_weights

    files = weight_files(base)
    shapes = weight_shapes(files)
    names = names or LoraNames(shapes, {})
    reads = [(_read(path, names, family), weight) for path, weight in loras]
    single = base.is_file()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = None if single else Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        for file in progress(files, desc="merge", unit="file"):
            weights = open_weights(file, device)
            for key, shape in weights.shapes.items():
                module = module_name(key)
                deltas = [(r, w) for r, w in reads if module in r.modules]
                if deltas:
                    total = weights.value(key).to(device)
                    for read, weight in deltas:
                        total += weight * read.delta(module, shape).to(total.device)
                    weights.store(key, total)
            weights.save(out if single else tmp_dir / file.name)
        if tmp_dir is not None:
            folder = files[0].parent
            for other in folder.iterdir():
                if other.is_file() and other.suffix != ".safetensors":
                    shutil.copy2(other, tmp_dir / other.name)
            replace_dir(tmp_dir, out)
    finally:
        if tmp_dir is not None and tmp_dir.exists():
            shutil.rmtree(tmp_dir)
    return out


@dataclass(frozen=True)
class Energy:
    """The share of the squared singular values kept, per module and over all of them."""

    modules: dict[str, float]
    total: float

    @classmethod
    def of(cls, kept: dict[str, tuple[float, float]]) -> Energy:
        """From {module: (squared singular values kept, all of them)}."""
        shares = {m: k / t if t > 0 else 1.0 for m, (k, t) in kept.items()}
        all_kept, everything = (sum(x) for x in zip(*kept.values()))
        return cls(shares, all_kept / everything if everything > 0 else 1.0)

    def line(self) -> str:
        worst = min(self.modules, key=self.modules.get)
        return (f"energy kept: {self.total:.4%} in all, least {self.modules[worst]:.4%} "
                f"({worst}), {len(self.modules)} modules")


def _low_rank(delta: torch.Tensor, rank: int):
    """(A, B, (squared singular values kept, all of them)) of the best rank-`rank`
    approximation B @ A of `delta` (SVD), the singular values split evenly between the
    factors."""
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    root = s[:rank].sqrt()
    energy = (float((s[:rank] ** 2).sum()), float((s ** 2).sum()))
    return root[:, None] * vh[:rank], u[:, :rank] * root, energy


def _component(files: list[Path]) -> str:
    return "unet" if files[0].parent.name == "unet" else "transformer"


def extract(base: Path, tuned: Path, rank: int, out: Path, device: str = "cpu",
            progress: Progress = quiet) -> Energy:
    """A rank-`rank` LoRA of `tuned` - `base` (both in one layout) by SVD of every matrix that
    differs: diffusers-named (`transformer.<module>.lora_A.weight`, peft's config in the
    metadata) for folders, ComfyUI-named with `.alpha` for single files; alpha = rank."""
    from safetensors import safe_open

    base_files, tuned_files = weight_files(base), weight_files(tuned)
    refuse_quantized(base_files + tuned_files)
    base_keys = {}
    for file in base_files:
        with safe_open(str(file), "pt") as f:
            base_keys.update((key, file) for key in f.keys())
    tuned_keys = []
    for file in tuned_files:
        with safe_open(str(file), "pt") as f:
            tuned_keys += [(key, file, tuple(f.get_slice(key).get_shape())) for key in f.keys()]
    pairs, energy = {}, {}
    for key, file, shape in progress(tuned_keys, desc="extract", unit="tensor"):
        module = module_name(key)
        if module is None or len(shape) != 2 or key not in base_keys:
            continue
        with safe_open(str(file), "pt", device=device) as f:
            new = f.get_tensor(key).float()
        with safe_open(str(base_keys[key]), "pt", device=device) as f:
            old = f.get_tensor(key).float()
        delta = new - old
        if not delta.any():
            continue
        if rank > min(shape):
            raise UserError(f"rank={rank} is larger than {module}'s rank limit {min(shape)} "
                            f"(its weight is {shape[0]}x{shape[1]}): give rank <= {min(shape)}")
        a, b, energy[module] = _low_rank(delta, rank)
        pairs[module] = (a.cpu(), b.cpu())
    if not pairs:
        raise UserError(f"{tuned} and {base}: no weight matrix of the same name differs")
    single = base.is_file()
    tensors, meta = {}, {"format": "pt"}
    prefix = "diffusion_model." if single else f"{_component(base_files)}."
    for module, (a, b) in sorted(pairs.items()):
        tensors[f"{prefix}{module}.lora_A.weight"] = a
        tensors[f"{prefix}{module}.lora_B.weight"] = b
        if single:
            tensors[f"{prefix}{module}.alpha"] = torch.tensor(float(rank))
    if not single:
        config = {"r": rank, "lora_alpha": rank, "target_modules": sorted(pairs)}
        meta["lora_adapter_metadata"] = json.dumps({f"{prefix}{k}": v for k, v in config.items()})
    save_atomically(tensors, out, meta)
    return Energy.of(energy)


def resize(lora: Path, rank: int, out: Path, device: str = "cpu",
           progress: Progress = quiet) -> Energy:
    """The LoRA at `lora` at rank `rank` (the best approximation of each module's delta, SVD),
    in its own format and names: alpha = the new rank where the file has alphas (tensors or
    peft's config), the scale folded into B either way. A rank above a module's is refused."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from dpipe.models.lora_read import detect_format, file_config, strip_prefix

    tensors = load_file(str(lora), device=device)
    with safe_open(str(lora), "pt") as f:
        meta = dict(f.metadata() or {})
    try:
        fmt, kind = detect_format(tensors)
    except LoraLayoutError as err:
        raise UserError(f"{lora}: {err}") from None
    if kind != Adapter.lora:
        raise UserError(f"{lora}: a {kind.value}; resize takes LoRA (A, B) files")
    _, configured = file_config(lora, meta, fmt)
    modules: dict[str, dict[str, str]] = {}
    for key in tensors:
        module, part = split_key(key)
        modules.setdefault(module, {})[part] = key
    out_tensors, energy = {}, {}
    for module, keys in progress(sorted(modules.items()), desc="resize", unit="module"):
        if "lora_A.weight" not in keys or "lora_B.weight" not in keys:
            raise UserError(f"{lora}: {module} has {sorted(keys)}, not a LoRA (A, B) pair")
        a, b = tensors[keys["lora_A.weight"]].float(), tensors[keys["lora_B.weight"]].float()
        if rank > a.shape[0]:
            raise UserError(f"rank={rank} is larger than the file's rank {a.shape[0]} of "
                            f"{module}: resize lowers a rank (give rank <= {a.shape[0]})")
        if "alpha" in keys:
            scale = float(tensors[keys["alpha"]]) / a.shape[0]
        else:
            scale = configured(strip_prefix(module)[0]) or 1.0
        # B @ A through QR of each factor: the SVD of a rank x rank matrix, not of the weight.
        qb, rb = torch.linalg.qr(b)
        qa, ra = torch.linalg.qr(a.T)
        small_a, small_b, energy[module] = _low_rank(scale * rb @ ra.T, rank)
        out_a, out_b = small_a @ qa.T, qb @ small_b
        dtype = tensors[keys["lora_A.weight"]].dtype
        out_tensors[keys["lora_A.weight"]] = out_a.to(dtype).cpu()
        out_tensors[keys["lora_B.weight"]] = out_b.to(dtype).cpu()
        if "alpha" in keys:
            out_tensors[keys["alpha"]] = torch.tensor(float(rank))
    save_atomically(out_tensors, out, _resized_metadata(meta, rank))
    return Energy.of(energy)


def _resized_metadata(meta: dict[str, str], rank: int) -> dict[str, str]:
    """The file's metadata with its rank and alpha (peft's config, kohya's ss_network_*) those
    of a rank-`rank` LoRA at scale 1."""
    meta = dict(meta)
    if "lora_adapter_metadata" in meta:
        config = json.loads(meta["lora_adapter_metadata"])
        for key in list(config):
            leaf = key.rsplit(".", 1)[-1]
            if leaf in ("r", "lora_alpha", "alpha"):
                config[key] = rank
            elif leaf in ("rank_pattern", "alpha_pattern"):
                config[key] = {}
        meta["lora_adapter_metadata"] = json.dumps(config)
    for key in ("ss_network_dim", "ss_network_alpha"):
        if key in meta:
            meta[key] = str(rank)
    return meta


def convert(lora: Path, spec, out: Path, progress: Progress = quiet) -> list[Path]:
    """The LoRA at `lora` (any format read) written in every format the family of `spec`
    writes, into the folder `out` (as a run's export: the diffusers file, ComfyUI's or kohya's,
    exports.json). The scale is folded into B (alpha = rank)."""
    from dpipe.models.adapters import lora_config_from_shapes
    from dpipe.models.lora_names import lora_names

    shapes = weight_shapes(weight_files(spec.path / spec.denoiser_folder))
    try:
        read = read_lora(lora, lora_names(spec, shapes), spec.cfg.family)
    except LoraLayoutError as err:
        raise UserError(f"{lora}: {err}") from None
    tensors = read.tensors()
    if read.kind in (Adapter.lora, Adapter.dora):
        metadata = lora_config_from_shapes(tensors)
        if read.kind == Adapter.dora:
            metadata["use_dora"] = True
    else:
        ranks = read.ranks()
        rank = max((r for r in ranks.values() if r is not None), default=1)
        metadata = {"r": rank, "alpha": rank, "target_modules": sorted(read.modules),
                    **({k: v for k, v in read.config.items() if k == "decompose_factor"})}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        written = spec.export_lora(tensors, metadata, tmp)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return [out / path.name for path in written]


STEP_EXPORT = re.compile(r"step_(\d+)")


def ema(run_dir: Path, decay: float, out: Path, progress: Progress = quiet) -> list[int]:
    """Post-hoc EMA of a run's step exports (`<run>/lora/step_<N>/`): the average of every
    tensor of their diffusers files that an EMA with `decay` per step would hold at the last
    export, each export standing for the weights since the one before (weight
    decay^(T - N_i) - decay^(T - N_(i-1)); the first also holds the start's decay^T). Written
    as the diffusers file `out` with the last export's metadata; returns the steps used."""
    from safetensors import safe_open

    from dpipe.models.lora_files import DIFFUSERS_LORA

    if not 0 < decay < 1:
        raise UserError(f"decay={decay}: give a per-step decay between 0 and 1, e.g. 0.999")
    exports = sorted((int(m.group(1)), p / DIFFUSERS_LORA)
                     for p in (run_dir / "lora").glob("step_*")
                     if (m := STEP_EXPORT.fullmatch(p.name)) and (p / DIFFUSERS_LORA).is_file())
    if len(exports) < 2:
        raise UserError(f"{run_dir}/lora holds {len(exports)} step export(s): post-hoc EMA "
                        "averages several (train.export_every_steps=N writes them)")
    last = exports[-1][0]
    weights, before = [], 0
    for step, _ in exports:
        weights.append(decay ** (last - step) - decay ** (last - before))
        before = step
    weights[0] += decay ** last
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for (step, file), weight in progress(list(zip(exports, weights)), desc="ema", unit="export"):
        with safe_open(str(file), "pt") as f:
            metadata = f.metadata()
            for key in f.keys():
                value = f.get_tensor(key)
                dtypes[key] = value.dtype
                value = value.double() * weight
                total[key] = total[key] + value if key in total else value
    save_atomically({k: v.to(dtypes[k]) for k, v in total.items()}, out, metadata)
    return [step for step, _ in exports]
