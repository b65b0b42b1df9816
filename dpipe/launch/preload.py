"""What the local launcher's fork server imports once, before it forks each worker.

The libraries every worker needs, whatever the model family, and dpipe's training path. Family
modules stay lazy (a run needs one). Nothing here may initialize CUDA: a forked worker could not
use it (see launch/local.py).
"""

import deepspeed  # noqa: F401
import deepspeed.runtime.pipe  # noqa: F401
import diffusers.models  # noqa: F401
import diffusers.models.transformers  # noqa: F401  (imports every diffusers transformer module)
import peft  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

import dpipe.pipeline.engine  # noqa: F401
import dpipe.train.loop  # noqa: F401

import atexit  # noqa: E402
import os  # noqa: E402

_SERVER_PID = os.getpid()


def _end_server_at_once() -> None:
    """The server ends when the launcher does: without freeing every module above one by one
    (~3 s of CPU), it is gone with the launcher's workers. The forked workers inherit this
    handler: in them it does nothing."""
    if os.getpid() == _SERVER_PID:
        os._exit(0)


atexit.register(_end_server_at_once)
