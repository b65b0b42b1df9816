"""dpipe: pipeline-parallel training of large diffusion models."""

__version__ = "0.1.0"
