"""Time limits inside SLURM jobs: checkpoint at a step every rank agrees on, then requeue.

SLURM warns a job before its time limit with a signal (submitit asks for USR2, `signal_delay_s`
seconds ahead). submitit's own handler would requeue at once, mid-step, without a checkpoint;
dpipe replaces it on every rank with one that only raises a flag. At each step boundary the loop
all-reduces the ranks' flags (one tiny int tensor, together with rank 0's verdict on time-based
checkpoints), so every rank saves the same step; then rank 0 hands over to submitit, which
pickles the job again and calls `scontrol requeue`, and every rank exits. The requeued job
resumes from that checkpoint (train.resume).

An external requeue or a preemption sends SIGTERM with no warning: nothing happens here (submitit
ignores SIGTERM, SLURM kills the job after its grace time); the job restarts and resumes from the
newest complete periodic checkpoint.

The workers of the local launcher (dpipe.launch.local) use the same flag and the same agreement
for a user's stop: SIGINT (Ctrl-C) or SIGTERM, which the launcher forwards to them
(`install_local_stop`). They save the agreed step and leave the loop; nothing is requeued.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist

log = logging.getLogger("dpipe")

EXIT_REQUEUED = 75  # EX_TEMPFAIL: this attempt ended to be requeued

_state = {"installed": False, "requested": False, "stop": False, "submitit_handler": None,
          "signal": signal.SIGUSR2, "requeue": True}


def install() -> bool:
    """Routes the time-limit signal of a submitit SLURM task to a flag. Returns whether it did.

    Must run after submitit set its handlers (it does before calling the task), on every rank.
    """
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return False
    from submitit.core.job_environment import JobEnvironment

    sig = JobEnvironment._usr_sig()
    previous = signal.getsignal(sig)
    if not _state["installed"]:
        _state["submitit_handler"], _state["signal"] = previous, sig
        signal.signal(sig, _on_signal)
        _state["installed"] = True
    return True


def _on_signal(signum, frame) -> None:  # noqa: ARG001
    if not _state["requested"]:
        # print, not log: logging is not safe inside a signal handler
        print(f"dpipe: caught {signal.Signals(signum).name} (time limit or preemption): "
              "checkpointing at the next step boundary, then requeueing", file=sys.stderr, flush=True)
    _state["requested"] = True


def install_local_stop() -> None:
    """A worker of the local launcher: SIGINT and SIGTERM raise the stop flag (the ranks then
    save the step they agree on and return, see `requeues`). A terminal's Ctrl-C reaches every
    worker as well as the launcher: each signal only sets the flag again; a second one is the
    launcher's to act on (it kills the workers)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_stop_signal)
    _state["installed"], _state["requeue"] = True, False


def _on_stop_signal(signum, frame) -> None:  # noqa: ARG001
    _state["requested"] = True


def requeues() -> bool:
    """Whether an agreed stop requeues the job (SLURM's time limit) rather than ends the run
    after its checkpoint (a user's stop, under the local launcher)."""
    return _state["requeue"]


def request() -> None:
    """Asks for a checkpoint and requeue as the signal would (for tests and callers)."""
    _state["requested"] = True


def agree(time_due_on_rank0: bool, timed_checkpoints: bool) -> tuple[bool, bool]:
    """(time-based checkpoint due, stop and requeue), the same on every rank.

    A collective: every rank must call it at the same step. No communication when neither the
    signal handler nor time-based checkpoints are in use.
    """
    if not (_state["installed"] or timed_checkpoints):
        return False, False
    flags = torch.tensor(
        [int(time_due_on_rank0 and dist.get_rank() == 0), int(_state["requested"])],
        dtype=torch.int32,
    )
    # Over gloo, between the hosts: through NCCL the flags would go to the GPU and back, a host
    # sync at every step (the GPU idles while the host queues the next step's first kernels).
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=_host_group())
    time_due, stop = bool(flags[0].item()), bool(flags[1].item())
    _state["stop"] = stop
    return time_due, stop


def _host_group():
    """A gloo group of every rank, made at the first agreement (a collective: every rank calls
    `agree` at the same step); the default group where that already is gloo."""
    if dist.get_backend() == "gloo":
        return None
    if _state.get("host_group") is None:
        _state["host_group"] = dist.new_group(backend="gloo")
    return _state["host_group"]


def stop_agreed() -> bool:
    return _state["stop"]


def requeue_and_exit(step: int) -> None:
    """After every rank has saved `step`: rank 0 has submitit requeue the job; every rank exits."""
    error: BaseException | None = None
    if dist.get_rank() == 0:
        log.warning("checkpoint of step %d complete: requeueing the job", step)
        handler = _state["submitit_handler"]
        if callable(handler):
            try:
                # submitit's handler: pickles the job again (the launcher's checkpoint()) and runs
                # `scontrol requeue`, then exits; or raises when it may not requeue any more.
                handler(_state["signal"], None)
            except SystemExit:
                pass
            except subprocess.CalledProcessError as err:
                # e.g. SLURM is already requeueing it (a preemption sends the signal too)
                log.warning("`scontrol requeue` failed (%s); exiting for SLURM to restart the job", err)
            except Exception as err:  # noqa: BLE001 - reported after the barrier
                error = err
        else:
            error = RuntimeError("no submitit signal handler to requeue the job with")
    dist.barrier()  # nobody leaves before the requeue was asked for (srun -K would kill rank 0)
    if error is not None:
        log.error("could not requeue: %s", error)
        raise error
    sys.exit(EXIT_REQUEUED)
