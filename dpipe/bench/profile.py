"""Where a training step's time goes: one step under torch.profiler, its kernels summed by kind.

`dpipe-bench --profile` runs it after the timed steps (not in their figures) and writes, per
rank, `profile_rank<N>.txt`: device time by kind (matmuls, attention, the fused Triton kernels of
compiled blocks, other element-wise and reduction kernels, communication, copies) and the top
kernels. With every timed family at 44-52% of the matmul peak in executed FLOPs
(docs/performance.md), this says what the rest of the step is. On the CPU (the tiny smoke test)
it sums the CPU ops instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch.autograd import DeviceType

# Kernel (or CPU op) names -> kind; the first pattern that matches names it.
KINDS = [
    # cudnn::fusion: the helper kernels of cuDNN's SDPA backward (rowsum(dO * O), dQ's cast).
    ("attention", re.compile(r"flash|fmha|attention|sdpa|_efficient_attention|cudnn::fusion",
                             re.I)),
    ("communication", re.compile(r"nccl|gloo|allreduce|all_reduce|sendrecv", re.I)),
    ("matmul", re.compile(
        r"gemm|cutlass|xmma|nvjet|cublas|wgmma|triton_tem|aten::(mm|bmm|addmm|matmul|linear)\b",
        re.I)),  # triton_tem: compiled matmul templates
    ("copy", re.compile(r"memcpy|memset|aten::(copy_|to|_to_copy|contiguous)\b", re.I)),
    ("fused (Triton)", re.compile(r"triton", re.I)),
    ("element-wise and reductions", re.compile(
        r"elementwise|vectorized|reduce|norm|softmax|aten::(add|mul|sub|div|silu|gelu|cat|sum"
        r"|mean)", re.I)),
]


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def profiled_step(run_step, out: Path, cuda: bool, top: int = 25) -> dict[str, float]:
    """Runs `run_step()` once under the profiler; writes the summary to `out` and returns the
    milliseconds per kind. The step runs even where the profiler fails (every pipeline stage
    must take part in it); the failure is then what `out` says."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    try:
        prof.start()
    except Exception as e:  # noqa: BLE001 (no profile is no reason to lose the step)
        prof, failure = None, e
    run_step()
    if cuda:
        torch.cuda.synchronize()
    try:
        if prof is None:
            raise failure
        prof.stop()
        return _summarize(prof, out, cuda, top)
    except Exception as e:  # noqa: BLE001
        out.write_text(f"profile failed: {type(e).__name__}: {e}\n")
        return {}


def _summarize(prof, out: Path, cuda: bool, top: int) -> dict[str, float]:
    events = list(prof.key_averages())
    if cuda:  # the kernels' own device time (the CPU ops that launch them are left out)
        timed = [(e.key, e.self_device_time_total / 1000) for e in events
                 if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    else:  # CPU: the ATen ops' own time (their children counted apart)
        timed = [(e.key, e.self_cpu_time_total / 1000) for e in events
                 if e.key.startswith("aten::") and e.self_cpu_time_total > 0]
    by_kind: dict[str, float] = {}
    for name, ms in timed:
        kind = kind_of(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    total = sum(by_kind.values()) or 1.0
    lines = [f"one step, {'GPU kernel' if cuda else 'CPU op'} time by kind (ms, share)"]
    lines += [f"{kind:30s} {ms:12.1f}  {ms / total:6.1%}"
              for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    lines += ["", f"top {top} by own time (ms): kind | name"]
    lines += [f"{ms:12.2f}  {kind_of(name)} | {name[:160]}"
              for name, ms in sorted(timed, key=lambda kv: -kv[1])[:top]]
    out.write_text("\n".join(lines) + "\n")
    return by_kind
