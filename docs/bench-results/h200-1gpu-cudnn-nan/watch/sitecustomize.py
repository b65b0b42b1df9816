"""Watches every scaled_dot_product_attention call of a process (eager only), when
SDPA_WATCH=DIR is set: on PYTHONPATH, Python imports this at start-up in each worker.

Per call it logs the shapes, strides, mask and kernel flags (the first 40 calls); it checks the
output and, through tensor hooks, the gradients of q, k and v for NaN/inf. The first few calls
with a non-finite result are saved whole (q, k, v, mask, the incoming gradient, as views with
their strides) to DIR/case_<pid>_<n>.pt, for replay.py."""

import os

if os.environ.get("SDPA_WATCH"):
    import json

    import torch
    import torch.nn.functional as F

    _DIR = os.environ["SDPA_WATCH"]
    os.makedirs(_DIR, exist_ok=True)
    _real = F.scaled_dot_product_attention
    _state = {"calls": 0, "saved": 0}

    def _log(record):
        with open(os.path.join(_DIR, f"calls_{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def _describe(t):
        if t is None:
            return None
        return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype),
                "contiguous": t.is_contiguous()}

    def _save(kind, n, q, k, v, mask, kwargs, grad_out, grads=None):
        if _state["saved"] >= 4:
            return
        _state["saved"] += 1
        path = os.path.join(_DIR, f"case_{os.getpid()}_{n}_{kind}.pt")
        torch.save({"q": q.detach(), "k": k.detach(), "v": v.detach(),
                    "mask": None if mask is None else mask.detach(), "kwargs": kwargs,
                    "grad_out": grad_out, "grads": grads}, path)
        _log({"saved": path, "kind": kind, "call": n})

    def watched(*args, **kwargs):
        # Called positionally (q, k, v, mask, ...) or by name (query=, key=, value=, attn_mask=).
        names = ["query", "key", "value", "attn_mask"]
        bound = dict(zip(names, args), **{a: b for a, b in kwargs.items() if a in names})
        q, k, v, attn_mask = (bound.get(a) for a in names)
        args = args[4:]
        kwargs = {a: b for a, b in kwargs.items() if a not in names}
        n = _state["calls"]
        _state["calls"] += 1
        out = _real(q, k, v, attn_mask, *args, **kwargs)
        if n < 40:
            _log({"call": n, "q": _describe(q), "k": _describe(k), "v": _describe(v),
                  "mask": _describe(attn_mask), "args": [str(a) for a in args],
                  "kwargs": {a: str(b) for a, b in kwargs.items()},
                  "cudnn_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
                  "grad": torch.is_grad_enabled() and q.requires_grad})
        if not torch.isfinite(out).all():
            _log({"call": n, "non_finite": "forward output"})
            _save("forward", n, q, k, v, attn_mask, kwargs, None)
        if torch.is_grad_enabled() and out.requires_grad:
            held = {}

            def on_out(g):
                held["grad_out"] = g.detach().clone()
                if n < 40:  # the gradient as it arrives, before any later hook relays it out
                    _log({"call": n, "grad_out": _describe(g), "out_stride": list(out.stride())})
                if not torch.isfinite(g).all():
                    _log({"call": n, "non_finite": "incoming gradient"})

            out.register_hook(on_out)
            for name, t in (("dq", q), ("dk", k), ("dv", v)):
                if t.requires_grad:
                    def on_grad(g, name=name):
                        if not torch.isfinite(g).all():
                            bad = (~torch.isfinite(g)).sum().item()
                            _log({"call": n, "non_finite": name, "count": bad,
                                  "grad_out_finite": bool(torch.isfinite(held["grad_out"]).all())})
                            _save(name, n, q, k, v, attn_mask, kwargs, held.get("grad_out"))
                    t.register_hook(on_grad)
        return out

    F.scaled_dot_product_attention = watched
    torch.nn.functional.scaled_dot_product_attention = watched
