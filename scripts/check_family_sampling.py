"""Compares dpipe's sampler with the family's diffusers pipeline on a tiny model, in one process.

    .venv/bin/python scripts/check_family_sampling.py tiny_wan [--frames 5] [--steps 3]

Builds the tiny model (under $DPIPE_CACHE, default ~/.cache/dpipe), nudges its weights off their
initial values (so that every block matters), encodes the prompts as the cache does, denoises
through the family's pipeline layers with `FamilySampling`, runs `diffusers_sample` on the same
weights, and prints the largest difference of the final latents. A starting point for a new
family's sampler; tests/integration/test_families.py checks every family through the stages.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def model_config(name: str):
    from omegaconf import OmegaConf

    from dpipe.config.schema import ModelConfig

    cfg = OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml")
    cfg.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg)
    return OmegaConf.to_object(merged)


def control_image(width: int, height: int) -> torch.Tensor:
    """A smooth test image, (3, H, W) in [-1, 1]."""
    y, x = torch.meshgrid(torch.linspace(-1, 1, height), torch.linspace(-1, 1, width),
                          indexing="ij")
    return torch.stack([x, y, x * y])


def main() -> int:
    from dpipe.models.registry import build_spec
    from dpipe.models.sampling import SampleRequest
    from dpipe.sample.denoise import denoise
    from dpipe.sample.link import StageLink

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a tiny model config, e.g. tiny_flux")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--guidance", type=float, default=None)
    parser.add_argument("--width", type=int, default=None, help="default: 4 pixel multiples")
    parser.add_argument("--height", type=int, default=None, help="default: 3 pixel multiples")
    parser.add_argument("--control", action="store_true",
                        help="give a control image to a family that takes one without needing it")
    args = parser.parse_args()

    spec = build_spec(model_config(args.model))
    spec.ensure_available()
    sampling = spec.sampling()
    m = spec.pixel_multiple
    cpu = torch.device("cpu")
    guidance = sampling.default_guidance if args.guidance is None else args.guidance
    width, height = args.width or 4 * m, args.height or 3 * m
    control_path = None
    if sampling.needs_control or args.control:
        import tempfile

        from PIL import Image

        control_path = tempfile.mkstemp(prefix="dpipe-check-control-", suffix=".png")[1]
        pixels = ((control_image(width, height) + 1) * 127.5).round().byte().permute(1, 2, 0)
        Image.fromarray(pixels.numpy()).save(control_path)
    request = SampleRequest(0, "a red circle on a blue background", "blurry", 3, width, height,
                            args.frames, control_path)
    problem = sampling.check(request)
    if problem:
        print(problem)
        return 2
    encoders = spec.load_encoders(cpu, torch.float32)
    control = None
    if control_path is not None:
        from dpipe.images import load_image

        pixels = load_image(Path(control_path), *sampling.control_size(request))[None]
        if getattr(spec, "text_sees_control", False):
            text = spec.encode_prompts_with_controls(encoders, [request.prompt], pixels)
            uncond = spec.encode_prompts_with_controls(encoders, [request.negative_prompt], pixels)
        encode_videos = getattr(spec, "encode_videos", None)
        control = (encode_videos(encoders, pixels.unsqueeze(2)) if encode_videos
                   else spec.encode_images(encoders, pixels)).float()
    if not getattr(spec, "text_sees_control", False):
        text = spec.encode_prompts(encoders, [request.prompt])
        uncond = spec.encode_negative_prompts(encoders, [request.negative_prompt])
    del encoders
    denoiser = spec.load_denoiser(torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in denoiser.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    reference = sampling.diffusers_sample(denoiser, request, args.steps, guidance)
    layers = spec.pipeline_layers(denoiser)

    def run(x):
        for layer in layers:
            x = layer(x)
        return x

    state = sampling.start(request, args.steps, guidance, text, uncond, control, cpu)
    link = StageLink.local(cpu)
    if denoise(sampling, [state], link, run, args.steps)[0]:
        raise SystemExit("dpipe's sampler failed") from link.error
    diff = (reference - state.latents).abs().max().item()
    print(f"{args.model}: latents {tuple(state.latents.shape)}, largest difference from "
          f"diffusers {diff:.3g} (values up to {reference.abs().max().item():.3g})")
    vae = sampling.load_vae(cpu, torch.float32)
    image = sampling.decode(vae, state.latents)
    print(f"decoded {tuple(image.shape)} in [{image.min().item():.3f}, {image.max().item():.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
