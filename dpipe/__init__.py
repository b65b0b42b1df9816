"""dpipe: pipeline-parallel training of large diffusion models."""

import logging

__version__ = "0.1.0"

# bitsandbytes (optim=adamw8bit; peft and diffusers import it whenever it is installed) warns at
# import, on CPUs with AVX512-BF16, that the `kernels` package for its 4-bit CPU matmul is
# missing: a layer dpipe never uses, in every run's console.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
