"""Eval loss: each eval set at fixed timesteps (quantiles of the training distribution), with
fixed noise per sample, run through the pipeline engine so it works with any stage count.

The same samples, noise and timesteps every time: two evals differ only by the model, and the
numbers do not depend on how many stages or data-parallel ranks ran them (samples are split
between ranks in the same order; DeepSpeed averages the micro-batch losses).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch

from dpipe.config.schema import EvalConfig, TimestepConfig
from dpipe.data.batches import CachedDataset, noised_batch, sample_conditions
from dpipe.data.manifest import Manifest, Sample
from dpipe.diffusion.timesteps import shift_timesteps, timestep_quantile
from dpipe.models.spec import ModelSpec

log = logging.getLogger(__name__)


def quantile_timestep(cfg: TimestepConfig, q: float, shift: float | None = None) -> float:
    """The q-quantile of the training timestep distribution, after the shift (`shift`, else
    the number `cfg.shift` gives)."""
    t = timestep_quantile(cfg, q)
    return float(shift_timesteps(t, cfg.fixed_shift if shift is None else shift))


def split_for_ranks(manifest: Manifest, data_parallel: int):
    """Per data-parallel rank, its micro-batches as lists of (sample, index in the set); and the
    samples no rank evaluates (fewer left in a bucket than ranks)."""
    ranks: list[list[list[tuple[Sample, int]]]] = [[] for _ in range(data_parallel)]
    left_out: list[Sample] = []
    index = 0
    for bucket in manifest.buckets:
        numbered = [(s, index + i) for i, s in enumerate(bucket.samples)]
        index += len(numbered)
        size = bucket.micro_batch_size
        full = len(numbered) // (size * data_parallel) * size * data_parallel
        groups = [(numbered[g:g + size * data_parallel], size)
                  for g in range(0, full, size * data_parallel)]
        rest = numbered[full:]
        if len(rest) >= data_parallel:  # one smaller batch for the remainder
            per = len(rest) // data_parallel
            groups.append((rest[:per * data_parallel], per))
            rest = rest[per * data_parallel:]
        left_out += [s for s, _ in rest]
        for members, per in groups:
            for r in range(data_parallel):
                ranks[r].append(members[r * per:(r + 1) * per])
    return ranks, left_out


class Evaluator:
    def __init__(self, spec: ModelSpec, dataset: CachedDataset, cfg: EvalConfig,
                 timesteps: TimestepConfig, data_parallel: int, dp_rank: int, seed: int,
                 run_dir: Path | None = None):
        self.spec, self.dataset, self.cfg, self.seed = spec, dataset, cfg, seed
        # shift=auto: each micro-batch's t follows from its size (`micro_batches`).
        self.times = [(q, None if timesteps.auto_shift else quantile_timestep(timesteps, q))
                      for q in cfg.quantiles]
        self.timesteps_cfg = timesteps
        self.sets = {}
        for name, manifest in dataset.evals.items():
            ranks, left_out = split_for_ranks(manifest, data_parallel)
            self.sets[name] = ranks[dp_rank]
            if left_out and dp_rank == 0:
                log.warning("eval set %s: %d sample(s) not evaluated (fewer left in their bucket "
                            "than the %d data-parallel ranks): %s", name, len(left_out),
                            data_parallel, ", ".join(s.source for s in left_out[:10]))
        self.jsonl = Path(run_dir) / "eval.jsonl" if run_dir is not None else None
        self._started = False

    def due(self, step: int) -> bool:
        if not self.sets:
            return False
        if step == 0:
            return self.cfg.before_training
        return bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    def maybe_run(self, engine, step: int, reporter=None) -> dict[str, float] | None:
        """Runs the evals if they are due at `step` (the same answer on every rank). A resumed
        run does not repeat the eval of the step it resumes at: it ran before the checkpoint."""
        first, self._started = not self._started, True
        if not self.due(step) or (first and step != 0):
            return None
        return self.run(engine, step, getattr(reporter, "writer", None))

    def micro_batches(self, name: str, q: float, t: float | None) -> Iterator[tuple[tuple, tuple]]:
        """The set's micro-batches at the q-quantile timestep: `t`, or with t None, the
        quantile under the shift (`shift=auto`) of each micro-batch's size."""
        number = list(self.sets).index(name)
        for members in self.sets[name]:
            samples = [s for s, _ in members]
            latents, text, weight, control = self.dataset.collate(
                samples, [s.texts[0] for s in samples])
            t_here = t if t is not None else quantile_timestep(
                self.timesteps_cfg, q, self.spec.training_shift(latents.shape[1:]))
            batch = noised_batch(
                self.spec, latents, text, self.timesteps_cfg, self.seed, -1 - number,
                [i for _, i in members], weight, control,
                timesteps=torch.full((len(samples),), t_here),
                conditions=sample_conditions(samples), audio=self.dataset.audio(samples))
            yield self.spec.make_inputs(batch)

    def run(self, engine, step: int, writer=None) -> dict[str, float]:
        """Every set at every quantile; collective over all ranks. Logs on the caller's rank 0."""
        results: dict[str, float] = {}
        for name, mine in self.sets.items():
            if not mine:  # too few samples for the ranks: warned about at start
                continue
            losses = []
            for q, t in self.times:
                loss = engine.eval_batch(iter(self.micro_batches(name, q, t)),
                                         num_micro_batches=len(mine))
                losses.append(float(loss))
                results[f"{name}/q{q:g}"] = losses[-1]
            results[f"{name}/mean"] = sum(losses) / len(losses)
        if writer is not None:
            for tag, value in results.items():
                writer.add_scalar(f"eval/{tag}", value, step)
            writer.flush()
            if self.jsonl is not None:
                with self.jsonl.open("a") as f:
                    f.write(json.dumps({"step": step, **results}) + "\n")
            log.info("eval at step %d: %s", step,
                     ", ".join(f"{k} {v:.4f}" for k, v in results.items() if k.endswith("mean")))
        return results
