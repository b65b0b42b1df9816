"""GPU time of a pipeline stage's work per step, from CUDA events around DeepSpeed's forward,
backward and optimizer instructions (read once per step: no sync inside the step).

A stage's compute stream waits for activations and gradients arriving on NCCL's stream, so
the time of a stage that waits for its neighbour includes some of that wait: the slowest stage's
figure is its compute, the others' are upper bounds. (Syncing the host before each instruction
to separate the two was tried: it stalls kernel launches and slowed the step by ~20%.)"""

from __future__ import annotations

import torch


class StageTiming:
    def __init__(self, engine):
        from deepspeed.runtime.pipe import schedule

        self.spans: dict[str, list] = {"forward": [], "backward": [], "optimizer": []}
        table = dict(engine._INSTRUCTION_MAP)
        for kind, name in ((schedule.ForwardPass, "forward"), (schedule.BackwardPass, "backward"),
                           (schedule.OptimizerStep, "optimizer")):
            table[kind] = self._timed(table[kind], self.spans[name])
        engine._INSTRUCTION_MAP = table  # the instance's map shadows the class's

    @staticmethod
    def _timed(fn, spans):
        def run(self, *args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(self, *args, **kwargs)
            end.record()
            spans.append((start, end))
            return out

        return run

    def collect(self) -> dict[str, float]:
        """Milliseconds per kind of work since the last call."""
        torch.cuda.synchronize()
        out = {}
        for name, spans in self.spans.items():
            out[name] = sum(a.elapsed_time(b) for a, b in spans)
            spans.clear()
        return out
