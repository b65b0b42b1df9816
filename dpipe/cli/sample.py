"""`dpipe-sample`: samples from a run's weights, or from a base model with a LoRA file.

    dpipe-sample run=outputs/my_run 'sample.prompts=[a cat, {prompt: a dog, seed: 3}]'
    dpipe-sample run=outputs/my_run export=step_1500 sample.steps=20 pipeline.stages=2
    dpipe-sample model=flux model.path=/models/FLUX.1-dev lora=/loras/style.safetensors \\
        'sample.prompts=[a cat]' out=outputs/samples

With `run=`, the run's own config (family, model path, precision) applies, with its final export
or the step export named by `export=` (`<run>/lora/step_<N>/`); the samples go to
`<run>/samples/<name>/` (name= sets it; default sampled-<export or final>). Without `run=`, the
config is composed as for dpipe-train (`model=...`), with the base weights and optionally a LoRA
file in any format the family's diffusers pipeline loads, into `<out>/<name>/`. Any `sample.*`
key applies (conf/sample/default.yaml). One process samples where the model fits on one GPU;
`pipeline.stages=N` splits it over N processes, as in training. Each folder gets an index.html.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from dpipe.errors import ConfigError, UserError

SPECIAL = ("run", "export", "lora", "out", "name")
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def main() -> None:
    from dpipe.launch.quiet import quiet_libraries

    quiet_libraries()
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if args else 2)
    try:
        job_dir, world = plan_job(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    from dpipe.launch.local import launch_workers

    code = launch_workers(job_dir, world, module="dpipe.launch.sample_worker")
    sys.exit(code)


def plan_job(args: list[str]) -> tuple[Path, int]:
    """Checks the arguments, saves the job in its output folder; (that folder, processes)."""
    import torch

    from dpipe.config.checks import validate
    from dpipe.launch.local import world_size_for
    from dpipe.models.registry import build_spec
    from dpipe.sample.job import SampleJob
    from dpipe.sample.requests import sample_requests

    special, overrides = {}, []
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq:
            raise ConfigError(f"{arg!r}: give key=value arguments (dpipe-sample --help)")
        if key in SPECIAL:
            special[key] = value
        else:
            overrides.append(arg)
    if not any(o.startswith("pipeline.stages=") for o in overrides):
        overrides.append("pipeline.stages=1")
    if "run" in special:
        for key in ("lora", "out"):
            if key in special:
                raise ConfigError(f"{key}= is for sampling a base model (model=...); with run= "
                                  "the run's own weights are used (export= picks a step export)")
        run_dir = Path(special["run"]).expanduser().resolve()
        if not (run_dir / "run.yaml").is_file():
            raise ConfigError(f"run={special['run']} holds no run (no run.yaml): give a run dir "
                              "that dpipe-train made, e.g. outputs/<name>")
        cfg = _compose(str(run_dir), "run", overrides)
    else:
        if "export" in special:
            raise ConfigError("export= picks a step export of a run: give run=<run dir> too")
        from dpipe.config.experiments import preset_overrides

        cfg = _compose(CONF_DIR, "config", preset_overrides(overrides) + ["name=samples"])
        if cfg.sample.ema:
            raise ConfigError("sample.ema=true samples from the EMA export of a run: give "
                              "run=<run dir> (or lora= with its ema/ file, without sample.ema)")
    run = validate(cfg)
    spec = build_spec(run.model)
    spec.ensure_available()
    # Sizes and frames as the run would choose them; written out so that every worker makes
    # exactly these requests.
    requests = sample_requests(run.sample, spec, run.dataset if "run" in special else None)
    if not requests:
        raise ConfigError("nothing to sample: give sample.prompts=[...] or "
                          "sample.prompts_file=<file> (conf/sample/default.yaml)")
    run.sample.prompts_file = None  # its prompts are among these now
    run.sample.prompts = [{"prompt": r.prompt, "negative_prompt": r.negative_prompt,
                           "seed": r.seed, "width": r.width, "height": r.height,
                           "frames": r.frames, **({"control": list(r.controls) if len(r.controls) > 1 else r.control}
                              if r.control else {})}
                          for r in requests]

    if "run" in special:
        lora = run.model.mode.value == "lora"
        exports = run_dir / ("lora" if lora else "model")
        export = special.get("export")
        weights_dir = exports / export if export else exports
        if run.sample.ema:  # the run had train.ema.decay > 0 (validate checks)
            from dpipe.train.export import EMA_DIR

            weights_dir = weights_dir / EMA_DIR
        if not weights_dir.is_dir() or export is not None and not export.startswith("step_"):
            steps = sorted(p.name for p in exports.glob("step_*")) if exports.is_dir() else []
            have = (["final"] if exports.is_dir() and any(exports.glob("*.safetensors"))
                    or (exports / "transformer").is_dir() else []) + steps
            raise ConfigError(
                f"{'export=' + export if export else 'the final export'}: {weights_dir} does not "
                f"exist. The run has: {', '.join(have) or 'no export yet'} (step exports come "
                "from train.export_every_steps)")
        weights = "lora" if lora else "full"
        name = special.get("name") or (f"sampled-{export or 'final'}"
                                       f"{'-ema' if run.sample.ema else ''}")
        folder = run_dir / "samples" / name
    else:
        out = Path(special.get("out", "outputs/samples")).expanduser().resolve()
        lora_file = special.get("lora")
        name = special.get("name") or (Path(lora_file).stem if lora_file else "base")
        folder = out / name
        weights, weights_dir = "base", None
        if lora_file:
            source = Path(lora_file).expanduser().resolve()
            if not source.is_file():
                raise ConfigError(f"lora={lora_file}: no such file; give a LoRA .safetensors file")
            from dpipe.models.safetensors_files import check_file

            check_file(source, "lora=")  # empty, cut short, or not safetensors: named here
            from dpipe.models.lora_files import DIFFUSERS_LORA

            linked = folder / ".lora" / DIFFUSERS_LORA  # the name the families' loaders read
            linked.parent.mkdir(parents=True, exist_ok=True)
            linked.unlink(missing_ok=True)
            linked.symlink_to(source)
            weights, weights_dir = "lora", str(linked.parent)
    folder.mkdir(parents=True, exist_ok=True)
    run_yaml = OmegaConf.to_yaml(OmegaConf.structured(run))
    SampleJob(run_yaml, weights, None if weights_dir is None else str(weights_dir),
              str(folder), f"{name} ({weights} weights)").save(folder)
    return folder, world_size_for(run, torch.cuda.device_count())


def _compose(config_dir: str, config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from dpipe.config.store import register_schemas

    register_schemas()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides)
    except HydraException as err:
        raise ConfigError(str(err).replace("\n", " ")) from None


if __name__ == "__main__":
    main()
