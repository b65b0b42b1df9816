"""Put on PYTHONPATH by call2.sh: every Python process but inductor's compile workers writes all
its threads' stacks every DPIPE_STACK_EVERY seconds to $OUT/stacks/<pid>.txt, so a run that never
reaches its first step shows where its time goes."""

import faulthandler
import os
import sys

if "compile_worker" not in " ".join(sys.argv) and os.environ.get("OUT"):
    os.makedirs(os.path.join(os.environ["OUT"], "stacks"), exist_ok=True)
    _file = open(os.path.join(os.environ["OUT"], "stacks", f"{os.getpid()}.txt"), "w")
    _file.write(" ".join(sys.argv) + "\n")
    _file.flush()
    faulthandler.dump_traceback_later(int(os.environ.get("DPIPE_STACK_EVERY", "120")),
                                      repeat=True, file=_file)
