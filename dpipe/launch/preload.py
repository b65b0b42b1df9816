"""What the local launcher's fork server imports once, before it forks each worker (and how the
server treats a stop signal).

The libraries every worker needs, whatever the model family, and dpipe's training path. Family
modules stay lazy (a run needs one). Nothing here may initialize CUDA: a forked worker could not
use it (see launch/local.py).
"""

import signal
import sys

from dpipe.launch.user_stop import STOP_SIGNALS

# The server must outlive its workers (it reports their exit codes) and not be cut short in its
# imports: a stop is the launcher's to act on, through each worker's pipe (launch/local.py). It
# was started with these signals blocked; ignored from here, and so in every worker forked from
# it until that installs its own handlers.
for _sig in STOP_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

# bitsandbytes (optim=adamw8bit) initializes CUDA when imported on a GPU machine (it reads each
# device's compute capability), and peft imports it whenever it is installed. Hidden here, peft
# and diffusers take it for absent (they use it only for bnb-quantized layers, which dpipe does
# not train); a worker imports it after the fork, where CUDA may start.
_hidden = "bitsandbytes" not in sys.modules
if _hidden:
    sys.modules["bitsandbytes"] = None  # find_spec says absent; an import raises ImportError

import deepspeed  # noqa: F401, E402
import deepspeed.runtime.pipe  # noqa: F401, E402
import diffusers.models  # noqa: F401, E402
import diffusers.models.transformers  # noqa: F401, E402  (every diffusers transformer module)
import peft  # noqa: F401, E402
import torch  # noqa: F401, E402
import transformers  # noqa: F401, E402

import dpipe.pipeline.engine  # noqa: F401, E402
import dpipe.train.loop  # noqa: F401, E402

if _hidden:
    del sys.modules["bitsandbytes"]
if torch.cuda.is_initialized():
    raise RuntimeError("an import in dpipe.launch.preload initialized CUDA, which forked workers "
                       "cannot use: import that module in the worker instead")

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
