"""Prior preservation: a dataset directory's `prior_preservation: true`.

Its files train towards the base model's own prediction instead of the data: before a step's
micro-batches go to DeepSpeed, those holding such files run once forward-only through the
stages with the adapters switched off (`dpipe.sample.link`, as samples do), on the same noisy
latents, timesteps and text; the last stage puts that prediction in place of their target. The
LoRA then learns to leave such images as the base model makes them (regularisation images),
at the cost of one forward pass without a backward per micro-batch that holds one.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from dpipe.data.batches import prior_rows
from dpipe.data.plan import BatchPlan
from dpipe.errors import UserError
from dpipe.sample.link import StageLink


class PriorTargets:
    """Collective within each pipeline (replica): every rank calls `retarget` at every step."""

    def __init__(self, spec, engine, plan: BatchPlan, dp_rank: int):
        self.spec, self.engine, self.plan, self.dp_rank = spec, engine, plan, dp_rank
        host = getattr(engine, "_host_group", None) if engine.num_stages > 1 else None
        self.link = StageLink.of_engine(engine, host)

    def retarget(self, step: int, micro_batches: Iterator[tuple[tuple, tuple]]
                 ) -> Iterator[tuple[tuple, tuple]]:
        """The step's micro-batches, with the base model's prediction as the target of every
        prior-preservation row (on the last stage, the one that reads the targets)."""
        rows = [prior_rows(self.plan.micro_batch(step, m, self.dp_rank).samples)
                for m in range(self.plan.micro_batches)]
        chosen = [k for k, r in enumerate(rows) if r]
        if not chosen:  # the same answer on every stage: the plan is a pure function of the step
            return micro_batches
        batches = list(micro_batches)
        inputs = [batches[k][0] for k in chosen] if self.link.first else None
        module = self.engine.module
        probe, module.probe = module.probe, None  # the memory planner measures training steps
        try:
            with torch.no_grad(), adapters_off(module):
                outputs = self.link.forward(module.forward, inputs, len(chosen),
                                            keep=lambda y: y)  # every stream's prediction
        finally:
            module.probe = probe
        if self.link.error is not None:
            error, self.link.error = self.link.error, None
            raise error
        if not self.link.last:
            return iter(batches)
        for k, output in zip(chosen, outputs):
            if output is None:  # an earlier stage failed and raised there; so does this one
                raise RuntimeError(f"prior preservation: step {step}'s base-model pass failed "
                                   "on an earlier pipeline stage (its log says why)")
            micro_inputs, labels = batches[k]
            batches[k] = (micro_inputs, self.spec.prior_labels(output, labels, rows[k]))
        return iter(batches)


@contextlib.contextmanager
def adapters_off(module: torch.nn.Module):
    """Every peft adapter layer of `module` runs its base layer alone; the parameters'
    requires_grad flags, which peft's switch changes, come back as they were."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise UserError("prior_preservation needs adapters to switch off: use model.mode=lora")
    grads = {p: p.requires_grad for p in module.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, wanted in grads.items():
            p.requires_grad_(wanted)
