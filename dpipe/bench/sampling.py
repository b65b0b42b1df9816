"""Time per sample of dpipe's sampler against the family's diffusers pipeline, on the same random
weights at a real size, on one GPU: FLUX.1 for now.

    python -m dpipe.bench.sampling --size dev --steps 28 --resolution 1024 [--compile]
    python -m dpipe.bench.sampling --size dev --steps 2 --dtype fp32     # exactness at real size

Both denoise the same prompt embeddings (random, at T5-XXL's 512 x 4096) from the same seed, in
--dtype: dpipe through the pipeline layers (`dpipe.sample.denoise`, one stage, the layers
compiled with --compile as training compiles them), twice in bf16: plain, and under autocast as
training runs a LoRA's layers (its adapters are fp32); FluxPipeline with its own transformer (its
blocks compiled with --compile), to latents (no VAE, no text encoders). Prints seconds per
sample (the mean of --repeats after one warm-up run, which compiles), the largest latent
difference from FluxPipeline's, and the GPU memory the denoising took above the resident
weights: what a training run's sampling round adds to the memory the weights already hold.
Random weights at real size amplify any rounding difference over the steps: --dtype fp32
shows whether the two compute the same.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

# FLUX.1-dev's scheduler and VAE configs (the parts the sampler reads: shift, latent shape).
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
             "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
             "base_image_seq_len": 256, "max_image_seq_len": 4096}
VAE = {"_class_name": "AutoencoderKL", "latent_channels": 16,
       "block_out_channels": [128, 256, 512, 512], "scaling_factor": 0.3611,
       "shift_factor": 0.1159}


def config_folder(root: Path, transformer: dict) -> Path:
    vae = {**VAE, "latent_channels": transformer["in_channels"] // 4}  # 2x2 patches
    for part, config in (("scheduler", SCHEDULER), ("vae", vae), ("transformer", transformer)):
        (root / part).mkdir(parents=True, exist_ok=True)
        name = "scheduler_config.json" if part == "scheduler" else "config.json"
        (root / part / name).write_text(json.dumps(config))
    return root


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """(mean seconds, peak GiB above what was allocated before, last result), after a warm-up.
    On the CPU (a smoke test of --size tiny) memory reads 0."""
    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / repeats
    peak = (torch.cuda.max_memory_allocated() - resident) / 2**30 if cuda else 0.0
    return seconds, peak, out


def main() -> None:
    from diffusers import FluxPipeline
    from diffusers.schedulers import FlowMatchEulerDiscreteScheduler

    from dpipe.config.schema import ModelConfig
    from dpipe.models.flux.sizes import SAMPLE_SHAPES, SIZES
    from dpipe.models.registry import build_spec
    from dpipe.models.sampling import SampleRequest
    from dpipe.sample.denoise import denoise
    from dpipe.sample.link import StageLink

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="dev", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--guidance", type=float, default=3.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    folder = config_folder(Path(tempfile.mkdtemp()), SIZES[args.size])
    spec = build_spec(ModelConfig(family="flux", path=str(folder)))
    sampling = spec.sampling()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    denoiser = spec.random_denoiser(args.size, dtype, device).eval().requires_grad_(False)
    shapes = SAMPLE_SHAPES[args.size]
    text = {"t5": torch.randn(1, *shapes["t5"], device=device, dtype=dtype),
            "pooled": torch.randn(1, *shapes["pooled"], device=device, dtype=dtype)}
    request = SampleRequest(0, "bench", "", 0, args.resolution, args.resolution)

    layers = spec.pipeline_layers(denoiser)
    if args.compile:
        for layer in layers:
            layer.compile()

    def run_plain(x):  # floats in the weights' dtype, as dpipe's engine runs bf16 weights
        x = tuple(t.to(dtype) if t.is_floating_point() else t for t in x)
        for layer in layers:
            x = layer(x)
        return x

    def run_autocast(x):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return run_plain(x)

    def ours(run):
        def sample():
            state = sampling.start(request, args.steps, args.guidance, text, None, None, device)
            link = StageLink.local(device)
            if denoise(sampling, [state], link, run, args.steps)[0]:
                raise RuntimeError("dpipe's sampler failed") from link.error
            return state.latents
        return sample

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER)
    pipe = FluxPipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=denoiser)
    pipe.vae_scale_factor = 8
    pipe.set_progress_bar_config(disable=True)

    def theirs():
        with torch.no_grad():
            return pipe(prompt_embeds=text["t5"], pooled_prompt_embeds=text["pooled"],
                        height=args.resolution, width=args.resolution,
                        num_inference_steps=args.steps, guidance_scale=args.guidance,
                        generator=torch.Generator().manual_seed(0), output_type="latent").images

    results = {"dpipe sampler": timed(ours(run_plain), args.repeats)}
    if args.dtype == "bf16":
        results["dpipe, autocast"] = timed(ours(run_autocast), args.repeats)
    if args.compile:  # the same blocks, compiled as diffusers users compile them
        for block in [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]:
            block.compile()
    theirs_s, theirs_gib, packed = timed(theirs, args.repeats)
    from dpipe.models.common.latent_packing import unpack

    reference = unpack(packed.float(), results["dpipe sampler"][2]).float()
    weights = sum(p.numel() * p.element_size() for p in denoiser.parameters()) / 2**30
    mode = "compiled" if args.compile else "eager"
    print(f"FLUX.1-{args.size} ({weights:.1f} GiB of {args.dtype} weights), {args.resolution}^2, "
          f"{args.steps} steps, guidance {args.guidance}, {mode}:")
    for name, (seconds, gib, latents) in results.items():
        diff = (latents.float() - reference).abs().max().item()
        print(f"  {name:16s}: {seconds:.3f} s/sample ({seconds / theirs_s:.3f}x FluxPipeline's), "
              f"+{gib:.2f} GiB above the weights; largest latent difference {diff:.3g} "
              f"(values up to {reference.abs().max().item():.3g})")
    print(f"  {'FluxPipeline':16s}: {theirs_s:.3f} s/sample, +{theirs_gib:.2f} GiB above the weights")


if __name__ == "__main__":
    main()
