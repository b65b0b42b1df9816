"""The fork server's preload (dpipe.launch.preload) imports what every worker needs and nothing
that starts CUDA: a worker forked from a server that started CUDA cannot use the GPU.
bitsandbytes is the known case (peft imports it when installed; it reads the devices'
compute capabilities at import): it must stay out of the server and import in a worker."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli import REPO

CHECK = """
import sys
import dpipe.launch.preload
import torch
assert "bitsandbytes" not in sys.modules, "the preload imported bitsandbytes"
assert not torch.cuda.is_initialized()
import peft.tuners.lora  # the LoRA layers the workers build
import bitsandbytes  # what optim=adamw8bit imports in a worker
print("ok", bitsandbytes.__version__)
"""


@pytest.mark.slow
def test_the_preload_leaves_bitsandbytes_and_cuda_to_the_workers():
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("ok "), done.stdout[-2000:]
