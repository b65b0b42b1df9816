"""The plan as `dpipe-train --plan` prints it: a table per stage, host memory per step, the cache
disk, the step time, and for a plan that does not fit, what does not and the smallest change."""

from __future__ import annotations

from dpipe.plan.change import gib
from dpipe.plan.choose import Plan
from dpipe.plan.for_run import RunPlan
from dpipe.plan.machine import size


def stage_table(plan: Plan) -> list[str]:
    head = ("stage", "layers", "weights", "trainable", "activations", "transient", "peak",
            "planned", "recompute", "swap")
    rows = [head]
    for i, s in enumerate(plan.stage_plans):
        rows.append((str(i), f"{s.layers[0]}-{s.layers[1] - 1}", gib(s.weights),
                     gib(s.trainable), gib(s.activations), gib(s.transient), gib(s.peak),
                     gib(s.planned), f"{s.recompute}/{s.layers[1] - s.layers[0]}",
                     f"{s.swap} ({gib(s.swapped_bytes)} GiB)"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return ["  " + "  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]


def describe(rp: RunPlan, change: tuple[str, Plan] | None = None) -> str:
    plan = rp.plan
    frames = f" x {rp.frames} frames" if rp.frames > 1 else ""
    lines = [
        f"plan for {plan.machine.name}: {rp.footprint.family} ({rp.size}, "
        f"{rp.footprint.params / 1e9:.1f}B parameters, built on the meta device) at "
        f"{rp.resolution}^2{frames}",
        f"  layout: {plan.stages} stage{'s' if plan.stages > 1 else ''} x {plan.data_parallel} "
        f"data-parallel, base weights {plan.base}, split {plan.split or '-'}, "
        f"{plan.micro_batches} micro-batches per step",
        f"  GPU memory per stage, GiB (budget {gib(plan.budget)}; 'planned' adds the memory "
        "plan's safety factor and margin):",
        *stage_table(plan),
        "  host memory, GiB: " + "; ".join(f"{k} {gib(v)}" for k, v in plan.host.items())
        + f"; peak: {plan.host_peak[0]}",
        "  cache disk: " + (f"{size(plan.disk)} for {rp.files} files (latents and text)"
                            if plan.disk is not None else "not known (no dataset folder)"),
        f"  step time, estimated: {0.7 * plan.seconds_per_step:.1f}-"
        f"{1.4 * plan.seconds_per_step:.1f} s for {plan.samples_per_step} samples",
        "  keys: " + " ".join(plan.overrides),
    ]
    if plan.fits:
        lines.append("  fits")
        return "\n".join(lines)
    lines += [f"  does not fit: {p}" for p in plan.problems]
    if change is None:
        lines.append("  no single change tried fits (fp8, recompute/swap, a lower resolution, "
                     "up to 8 GPUs, up to 512 GiB of host memory)")
    else:
        words, fixed = change
        step, host = fixed.host_peak
        lines.append(f"  smallest change that fits: {words}: then {fixed.stages} stage(s) x "
                     f"{fixed.data_parallel}, base {fixed.base}, peak "
                     f"{gib(max(s.peak for s in fixed.stage_plans))} GiB per GPU, host "
                     f"{gib(host)} GiB ({step}); keys: {' '.join(fixed.overrides)}")
    return "\n".join(lines)
