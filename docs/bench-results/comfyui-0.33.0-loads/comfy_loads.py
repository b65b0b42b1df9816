"""dpipe's files loaded by ComfyUI itself: a dev tool, not a test (it needs a ComfyUI checkout,
which dpipe's tests and CI do not have; ComfyUI is GPL-3.0 and is only run here, never copied).
README.md beside it has the results and the commands.

    PYTHONPATH=<ComfyUI checkout>:<its packages>:<this folder>:<dpipe checkout> \
        python comfy_loads.py --out results.json RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a finished `dpipe-train` run of a tiny model (a LoRA, LoKr or LoHa run, or a
full fine-tune of a single file). For a LoRA-type run it writes the tiny model's transformer as
the family's single file (the family's `write_single_file`, or its converter, kept in fp32),
loads it as ComfyUI's Load Diffusion Model node does (`ComfyModel`), applies each ComfyUI-format
file of the run's `lora/` export as its Load LoRA node does (`ComfyModel.apply_lora`) and
compares every patched weight with dpipe's merge of the diffusers file
(`dpipe.models.lora_tools.merge`, written through the same single-file writer), and with
`dpipe-lora merge` of the ComfyUI file into the single file. For a full run it loads the
exported single file and compares it with the exported diffusers folder through the writer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import comfy_boot  # noqa: F401  (ComfyUI in CPU mode; must come before torch users of comfy)
import comfy.model_detection
import comfy.lora
import comfy.lora_convert
import comfy.sd
import comfy.utils
import torch

from dpipe.config.checks import validate
from dpipe.models.lora_tools import merge
from dpipe.models.registry import build_spec
from omegaconf import OmegaConf


class Log(logging.Handler):
    """ComfyUI's warnings and infos while loading (missing keys, LoRA keys not loaded)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextmanager
def comfy_log():
    handler = Log()
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        yield handler.lines
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@contextmanager
def fp32_kept():
    """The tiny writers store the released dtype (bf16); the comparison needs the fp32 values."""
    to = torch.Tensor.to

    def to_fp32(self, *args, **kwargs):
        half = (torch.bfloat16, torch.float16)
        if self.dtype == torch.float32:
            if kwargs.get("dtype") in half:
                kwargs.pop("dtype")
            args = tuple(a for a in args if a not in half)
            if not args and not kwargs:
                return self
        return to(self, *args, **kwargs)

    torch.Tensor.to = to_fp32
    try:
        yield
    finally:
        torch.Tensor.to = to


def _transformer_writer(convert):
    def write(folder: Path, file: Path) -> Path:
        from dpipe.models.single_file import write_transformer_file
        return write_transformer_file(folder / "transformer", file, convert)
    return write


def single_file_writer(family: str):
    """(folder, file) -> file: the family's single file of a diffusers folder."""
    for module in (f"dpipe.models.{family}.tiny", f"dpipe.models.hunyuan_video.{family}.tiny",
                   f"dpipe.models.ltx_video.{family}.tiny", "dpipe.models.ltx_video.ltx2.tiny"
                   if family.startswith("ltx2") else ""):
        try:
            tiny = importlib.import_module(module) if module else None
        except ImportError:
            continue
        if tiny is not None and hasattr(tiny, "write_single_file"):
            return tiny.write_single_file
    if family in ("flux", "flux2"):
        from dpipe.models.common.bfl_layout import save_bfl_file
        return lambda folder, file: save_bfl_file(folder / "transformer", file)
    if family == "wan":
        from dpipe.models.wan.comfyui import original_state_dict
        return _transformer_writer(original_state_dict)
    if family == "lumina2":
        from dpipe.models.lumina2.comfyui import native_state_dict
        return _transformer_writer(native_state_dict)
    if family == "ideogram4":  # dpipe writes no Ideogram 4 single file: ComfyUI's names (its
        # comfy/ldm/ideogram4/model.py) are diffusers' but for q, k, v stacked and to_out.0 -> o
        from dpipe.models.comfyui import fused_qkv_state
        return _transformer_writer(lambda sd: fused_qkv_state(
            sd, ".attention", lambda k: k.replace(".attention.to_out.0.", ".attention.o.")))
    if family == "krea2":  # dpipe writes no Krea 2 single file: its Linears renamed by ComfyUI's
        # own map (comfy.utils.krea2_to_diffusers), the norms left out
        return _transformer_writer(krea2_names)
    # ComfyUI holds these under diffusers' names (Qwen-Image, ERNIE-Image, OmniGen2)
    return _transformer_writer(dict)


def krea2_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks."))
    to_krea = comfy.utils.krea2_to_diffusers({"layers": layers})
    out = {krea: sd[name] for name, krea in to_krea.items() if name in sd}
    # detection reads the text width from this norm's scale
    norm, = [k for k in sd if k.startswith("text_fusion.layerwise_blocks.0.") and "norm" in k
             and k.endswith("weight") and sd[k].dim() == 1][:1]
    out["txtfusion.layerwise_blocks.0.prenorm.scale"] = sd[norm]
    return out


def tensors(file: Path) -> dict[str, torch.Tensor]:
    return comfy.utils.load_torch_file(str(file))


class ComfyModel:
    """ComfyUI's model of a single file, and the file's weights as ComfyUI names them (its
    `process_unet_state_dict` applied, as `BaseModel.load_model_weights` does).

    ComfyUI's model detection takes most sizes from real models (a head width of 128, fixed
    configs for ERNIE-Image, Ideogram 4, OmniGen2), so a tiny file often cannot be built at its
    own sizes. Then ("names" route) the model is detected from the file's shapes with every width
    of 4 or more times 8 (`SCALES` for some; the tiny head width 16 -> 128; the names and block counts, which is
    what detection reads them for, unchanged) and built on the meta device: its weight names are
    compared with the file's, and the LoRA's patches are computed by ComfyUI's own
    `comfy.lora.calculate_weight` on the file's tiny tensors."""

    def __init__(self, file: Path, scale: int = 8, sizes: dict[int, int] | None = None):
        self.scale, self.sizes = scale, sizes or {}
        with comfy_log() as lines:
            # as the Load Diffusion Model node reads a file: its header too (LTX-2, Wan and
            # MiniMax H3 files carry their config there)
            sd, self.metadata = comfy.utils.load_torch_file(str(file), return_metadata=True)
            self.prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
            stripped = {k[len(self.prefix):]: v for k, v in sd.items()
                        if k.startswith(self.prefix)} or sd
            self.route, self.error, self.model = None, None, None
            try:
                patcher = comfy.sd.load_diffusion_model_state_dict(
                    dict(sd), model_options={"dtype": torch.float32}, metadata=self.metadata,
                    disable_dynamic=True)
                if patcher is None:
                    raise ValueError("model type not detected")
                self.model, self.route = patcher.model, "loaded"
            except Exception as err:  # reported in the table: what ComfyUI raised
                self.error = f"{type(err).__name__}: {str(err)[:200]}"
                self._meta_model(stripped)
            self.lines = lines
        if self.model is None:
            return
        self.weights = self.model.model_config.process_unet_state_dict(dict(stripped))
        names = set(self.model.diffusion_model.state_dict())
        # a fixed real-size config (ERNIE-Image's 36 layers) has blocks the tiny file has not
        self.missing = sorted(k for k in names - set(self.weights)
                              if not (self.route == "names" and self._beyond_tiny_depth(k)))
        self.unexpected = sorted(set(self.weights) - names)

    def _beyond_tiny_depth(self, key: str) -> bool:
        """A key of a block the tiny file has not: its first numbered part is past the file's."""
        parts = key.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                block = ".".join(parts[:i + 1]) + "."
                return not any(k.startswith(block) for k in self.weights)
        return False

    # ComfyUI tells these apart by the exact width (Lumina 2: 2304, Z-Image: 3840); the tiny
    # widths (48, 32) are scaled to them
    SCALES = {"lumina2": 2304 // 48, "z_image": 3840 // 32}
    # Sizes ComfyUI matches exactly, given for the tiny ones: SD3's 16 latent channels (tiny 4)
    # and width 64 per block (tiny 16, 3 blocks); AuraFlow's text width 2048 (tiny 32); Cosmos'
    # 16 + 1 input channels in 2x2 patches (68, as the tiny ones) and widths (Cosmos-Predict2
    # 2048, Cosmos 1 7B 4096; tiny 32)
    SIZES = {"sd3": {4: 16, 16: 192}, "auraflow": {32: 2048},
             "cosmos_predict2": {32: 2048, 68: 68}, "cosmos1": {32: 4096, 68: 68}}

    def _size(self, d: int) -> int:
        return self.sizes.get(d, d * self.scale if d >= 4 else d)

    def _meta_model(self, stripped):
        shapes = {k: torch.empty(tuple(self._size(d) for d in v.shape), device="meta")
                  for k, v in stripped.items()}
        try:
            config = comfy.model_detection.model_config_from_unet(shapes, "",
                                                                  metadata=self.metadata)
            if config is None:
                self.error += "; by names: model type not detected"
                return
            unet = config.unet_config
            if {"dim", "n_heads", "axes_dims"} <= set(unet):  # Lumina 2 / Z-Image: fixed rope
                # axes (head width 128) and head counts; on the meta device only names matter
                unet["n_heads"] = unet["dim"] // sum(unet["axes_dims"])
                unet["n_kv_heads"] = min(unet.get("n_kv_heads") or unet["n_heads"], unet["n_heads"])
            config.set_inference_dtype(torch.float32, None)
            with torch.device("meta"):
                self.model = config.get_model(shapes, "")
            self.route = "names"
        except Exception as err:
            self.error += f"; by names: {type(err).__name__}: {str(err)[:200]}"

    def summary(self) -> dict:
        if self.model is None:
            return {"detected": None, "error": self.error}
        return {"detected": type(self.model).__name__,
                "model_config": type(self.model.model_config).__name__,
                "diffusion_model": type(self.model.diffusion_model).__name__,
                "route": self.route, "tiny_load_error": self.error,
                "missing": len(self.missing), "missing_first": self.missing[:5],
                "unexpected": len(self.unexpected), "unexpected_first": self.unexpected[:5]}

    def processed(self, file: Path) -> dict[str, torch.Tensor]:
        """Another file of this layout, as ComfyUI names its weights."""
        sd = tensors(file)
        stripped = {k[len(self.prefix):]: v for k, v in sd.items()
                    if k.startswith(self.prefix)} or sd
        return self.model.model_config.process_unet_state_dict(stripped)

    def apply_lora(self, lora: dict[str, torch.Tensor]):
        """As the Load LoRA node (`comfy.sd.load_lora_for_models`): ComfyUI's key map, its
        format conversion, its loader; then each patched weight by `calculate_weight` (what
        `ModelPatcher.patch_weight_to_device` computes). Returns (patched weights, log lines)."""
        import comfy.lora
        import comfy.lora_convert

        with comfy_log() as lines:
            key_map = comfy.lora.model_lora_keys_unet(self.model, {})
            loaded = comfy.lora.load_lora(comfy.lora_convert.convert_lora(lora), key_map)
            patches: dict[str, list] = {}
            for k, patch in loaded.items():
                key, offset, function = (k, None, None) if isinstance(k, str) else (
                    k[0], k[1], k[2] if len(k) > 2 else None)
                if offset is not None and self.route == "names":
                    # a slice of a fused weight, placed by the detected (scaled) widths
                    offset = (offset[0], offset[1] // self.scale, offset[2] // self.scale)
                patches.setdefault(key, []).append((1.0, patch, 1.0, offset, function))
            out = {}
            for key, patch_list in patches.items():
                name = key.removeprefix("diffusion_model.")
                if name not in self.weights:
                    lines.append(f"patch for a weight the file lacks: {key}")
                    continue
                out[name] = comfy.lora.calculate_weight(
                    patch_list, self.weights[name].float().clone(), key)
        return out, lines


def compare(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict:
    """max |got - expected| over the weights both hold."""
    worst, compared, worst_key = 0.0, 0, None
    for name, value in got.items():
        want = expected.get(name)
        if want is None or want.shape != value.shape:
            continue
        compared += 1
        diff = (value.float() - want.float()).abs().max().item()
        if diff >= worst:
            worst, worst_key = diff, name
    return {"compared": compared, "max_diff": worst, "max_diff_at": worst_key}


def comfy_lora_files(run_dir: Path) -> list[Path]:
    record = json.loads((run_dir / "lora" / "exports.json").read_text())
    return [run_dir / "lora" / name for name, info in record["formats"].items()
            if info.get("written") and name != "pytorch_lora_weights.safetensors"
            and not name.startswith("lycoris_")]


def merged_folder(folder: Path, denoiser: str, lora: Path, out: Path) -> Path:
    """`folder` with its denoiser merged with `lora` by dpipe (the other parts linked)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for entry in folder.iterdir():
        if entry.name != denoiser:
            (out / entry.name).symlink_to(entry)
    merge(folder / denoiser, [(lora, 1.0)], out / denoiser)
    return out


def merged_by_dpipe_lora(spec, family, base: Path, lora: Path, work: Path, model, patched):
    """`dpipe-lora merge base=<single file> lora=<this ComfyUI file> model=...` (its code:
    the family's names, `lora_tools.merge`), the merged file loaded as ComfyUI names it, against
    ComfyUI's own patched weights."""
    from dpipe.models import lora_tools
    from dpipe.models.lora_names import lora_names

    try:
        names = lora_names(spec, lora_tools.weight_shapes(lora_tools.weight_files(base)))
        out = lora_tools.merge(base, [(lora, 1.0)], work / f"merged-{lora.stem}.safetensors",
                               names=names, family=family)
        merged = model.processed(out)
        # the merge stores each weight in the file's dtype (the tiny folders' bf16 for some):
        # ComfyUI's fp32 result rounded to it, as ComfyUI rounds a patched weight to its dtype
        rounded = {k: v.to(merged[k].dtype) for k, v in patched.items() if k in merged}
        dtypes = sorted({str(merged[k].dtype).removeprefix("torch.") for k in rounded})
        return {**compare(rounded, merged), "dtype": dtypes}
    except Exception as err:  # reported in the table
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}


def check_lora_run(run_dir: Path, work: Path) -> dict:
    run = validate(OmegaConf.load(run_dir / "run.yaml"))
    spec = build_spec(run.model)
    family, folder = run.model.family, Path(spec.path)
    denoiser = getattr(spec, "denoiser_folder", "transformer")
    work.mkdir(parents=True, exist_ok=True)
    write = single_file_writer(family)
    row = {"run": run_dir.name, "family": family, "adapter": str(run.model.adapter),
           "kind": str(getattr(run.model.lora, "kind", ""))}
    with fp32_kept():
        base = write(folder, work / "base.safetensors")
    model = ComfyModel(base, ComfyModel.SCALES.get(family, 8), ComfyModel.SIZES.get(family))
    row["model"] = model.summary()
    if model.model is None:
        return row
    lycoris = sorted((run_dir / "lora").glob("lycoris_*.safetensors"))
    source = lycoris[0] if lycoris else run_dir / "lora" / "pytorch_lora_weights.safetensors"
    try:
        with fp32_kept():  # dpipe's merge kept in fp32 as well
            merged = write(merged_folder(folder, denoiser, source, work / "merged"),
                           work / "merged.safetensors")
    except Exception as err:  # e.g. Anima's text adapter: a LoRA of two folders
        row["expected_error"] = f"{type(err).__name__}: {str(err)[:200]}"
        merged = base
    expected = model.processed(merged)
    changed = {k for k, v in expected.items()
               if k in model.weights and not torch.equal(v, model.weights[k])}
    row["dpipe_changed_weights"] = len(changed)
    row["max_delta"] = max(((expected[k] - model.weights[k]).abs().max().item() for k in changed),
                           default=0.0)
    row["loras"] = []
    for file in comfy_lora_files(run_dir):
        lora = tensors(file)
        patched, lines = model.apply_lora(lora)
        not_loaded = [line.removeprefix("lora key not loaded: ") for line in lines
                      if line.startswith("lora key not loaded")]
        entry = {"file": file.name, "keys": len(lora),
                 "keys_applied": len(lora) - len(not_loaded), "not_loaded": len(not_loaded),
                 "not_loaded_first": not_loaded[:5], "weights_patched": len(patched),
                 "other_lines": [x for x in lines if "lora key not loaded" not in x][:5],
                 "changed_not_patched": len(changed - set(patched)),
                 "changed_not_patched_first": sorted(changed - set(patched))[:5]}
        entry.update(compare(patched, expected))
        entry["dpipe_lora_merge"] = merged_by_dpipe_lora(spec, family, base, file, work, model,
                                                         patched)
        row["loras"].append(entry)
    return row


def check_full_run(run_dir: Path, work: Path) -> dict:
    """The exported single file of a full fine-tune, loaded by ComfyUI, against the exported
    diffusers folder written through the family's writer (fp32)."""
    run = validate(OmegaConf.load(run_dir / "run.yaml"))
    spec = build_spec(run.model)
    family = run.model.family
    files = sorted(p for p in (run_dir / "model").glob("*.safetensors"))
    row = {"run": run_dir.name, "family": family, "adapter": "full",
           "files": [f.name for f in files]}
    if not files:
        row["model"] = {"detected": None, "error": "no single file exported"}
        return row
    model = ComfyModel(files[0], ComfyModel.SCALES.get(family, 8),
                       ComfyModel.SIZES.get(family))
    row["model"] = model.summary()
    if model.model is not None:
        work.mkdir(parents=True, exist_ok=True)
        folder = work / "exported"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        denoiser = getattr(spec, "denoiser_folder", "transformer")
        for entry in Path(spec.path).iterdir():
            if entry.name != denoiser:
                (folder / entry.name).symlink_to(entry)
        (folder / denoiser).symlink_to(run_dir / "model" / denoiser)
        with fp32_kept():
            written = single_file_writer(family)(folder, work / "exported.safetensors")
        row["vs_exported_folder"] = {
            **compare(model.weights, model.processed(written)),
            "dtype": sorted({str(v.dtype).removeprefix("torch.") for v in model.weights.values()})}
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("comfy-loads-work"))
    args = parser.parse_args()
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for run_dir in args.runs:
        run = OmegaConf.load(run_dir / "run.yaml")
        work = args.work / run_dir.parent.name / run_dir.name
        try:
            row = (check_full_run if str(run.model.mode) == "full" else check_lora_run)(
                run_dir, work)
        except Exception as err:  # one family's failure is a row of the table
            import traceback
            row = {"run": run_dir.name, "error": f"{type(err).__name__}: {err}",
                   "trace": traceback.format_exc()[-1500:]}
        results[str(run_dir)] = row
        print(json.dumps(row, indent=1), flush=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
