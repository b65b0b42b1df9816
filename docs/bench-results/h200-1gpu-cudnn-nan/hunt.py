"""Where does model.attention=cudnn's NaN come from? (tests/gpu: the tiny FLUX model's second
step gave a NaN loss on an H200, cuDNN's kernel first.) `python hunt.py OUT` from the repo root.

1. Trains the tiny FLUX model 4 steps per kernel (sdpa, cudnn) and mode (eager, compiled), each
   compiled run with its own inductor cache (the caches do not key on SDPA's flags), and prints
   each step's loss. The eager runs go through watch/sitecustomize.py: every SDPA call's shapes,
   and the first calls whose output or q/k/v gradient is not finite, saved whole.
2. Replays each saved call: its gradients again with cuDNN (the same views, then contiguous
   copies), flash, memory-efficient and an fp32 math reference; the sequence length, the mask,
   and the smallest log-sum-exp of a query row."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from tests.cli import dpipe_train, metrics, train_args  # noqa: E402

BASE = ["model=tiny_flux", "dataset=synthetic", "train.precision=bf16", "train.max_steps=4",
        "pipeline.micro_batches=4", "train.checkpoint_every_steps=0", "pipeline.stages=1",
        "pipeline.data_parallel=1"]


def train(out: Path, kernel: str, compiled: bool, *extra: str, tag: str = "",
          watch: bool = True) -> None:
    """Trains the tiny FLUX model (BASE and `extra` overrides) and prints its losses."""
    tag = f"{kernel}-{'compiled' if compiled else 'eager'}{tag}"
    env = dict(os.environ)
    if compiled:
        env["TORCHINDUCTOR_CACHE_DIR"] = f"/tmp/inductor-{tag}"
    elif watch:
        env["SDPA_WATCH"] = str(out / f"watch-{tag}")
        env["PYTHONPATH"] = f"{HERE / 'watch'}:{env.get('PYTHONPATH', '')}"
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        run_dir = Path(f"/tmp/hunt-{tag}")
        result = dpipe_train(*train_args(run_dir, *BASE, f"model.attention={kernel}",
                                         f"pipeline.compile={str(compiled).lower()}", *extra),
                             timeout=400)
    finally:
        os.environ.clear()
        os.environ.update(old)
    if result.code:
        print(f"{tag}: exit {result.code}\n{result.err[-2000:]}", flush=True)
        return
    rows = metrics(run_dir)
    print(f"{tag}: losses {[round(m['loss'], 5) for m in rows]}; "
          f"grad norms {[None if m.get('grad_norm') is None else round(m['grad_norm'], 4) for m in rows]}", flush=True)


def grads(q, k, v, mask, kwargs, grad_out, backend):
    from torch.nn.attention import sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([backend]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def replay(out: Path) -> None:
    from torch.nn.attention import SDPBackend

    cases = sorted(glob.glob(str(out / "watch-*" / "case_*.pt")))
    print(f"{len(cases)} saved non-finite calls", flush=True)
    for path in cases:
        c = torch.load(path)
        q, k, v, mask, kwargs, g = c["q"], c["k"], c["v"], c["mask"], c["kwargs"], c["grad_out"]
        print(f"== {Path(path).parent.name}/{Path(path).name}: q {list(q.shape)} stride "
              f"{list(q.stride())}, k {list(k.shape)}, mask "
              f"{None if mask is None else (list(mask.shape), str(mask.dtype))}, kwargs {kwargs}; "
              f"incoming gradient {'missing' if g is None else 'finite' if torch.isfinite(g).all() else 'NOT finite'}",
              flush=True)
        if g is None:
            continue
        scale = kwargs.get("scale") or q.shape[-1] ** -0.5
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
                else scores + mask.float()
        lse = torch.logsumexp(scores, -1)
        print(f"   tokens {q.shape[-2]} (mod 128: {q.shape[-2] % 128}); score range "
              f"{scores[torch.isfinite(scores)].min().item():.1f}..{scores.max().item():.1f}; "
              f"smallest row log-sum-exp {lse.min().item():.1f}; |q| max {q.abs().max().item():.1f}, "
              f"|k| max {k.abs().max().item():.1f}", flush=True)
        variants = {"cudnn (same views)": (SDPBackend.CUDNN_ATTENTION, False),
                    "cudnn (contiguous)": (SDPBackend.CUDNN_ATTENTION, True),
                    "flash": (SDPBackend.FLASH_ATTENTION, False),
                    "efficient": (SDPBackend.EFFICIENT_ATTENTION, False)}
        ref = grads(q.float(), k.float(), v.float(), mask, kwargs, g.float(), SDPBackend.MATH)
        for name, (backend, contiguous) in variants.items():
            args = [t.contiguous() if contiguous else t for t in (q, k, v)]
            try:
                got = grads(*args, mask, kwargs, g.contiguous() if contiguous else g, backend)
            except RuntimeError as e:
                print(f"   {name}: refused ({str(e)[:100]})", flush=True)
                continue
            parts = []
            for label, t, r in zip(("out", "dq", "dk", "dv"), got, ref):
                bad = (~torch.isfinite(t)).sum().item()
                err = ((t.float() - r).abs().max() / r.abs().max()).item() if not bad else float("nan")
                parts.append(f"{label} {'%d non-finite' % bad if bad else 'rel. err %.1e' % err}")
            print(f"   {name}: {'; '.join(parts)}", flush=True)


def main() -> None:
    out = Path(sys.argv[1])
    print(torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
    for kernel in ("sdpa", "cudnn"):
        for compiled in (False, True):
            train(out, kernel, compiled)
    for calls in sorted(glob.glob(str(out / "watch-*" / "calls_*.jsonl"))):
        lines = Path(calls).read_text().splitlines()
        bad = [json.loads(x) for x in lines if "non_finite" in x]
        print(f"{Path(calls).parent.name}/{Path(calls).name}: {len(lines)} lines, first call "
              f"{lines[0][:400] if lines else '-'}; non-finite: {bad[:6]}", flush=True)
    replay(out)


if __name__ == "__main__":
    main()
