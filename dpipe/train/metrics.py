"""What rank 0 shows and records: a progress bar, metrics.jsonl, and the loggers of
`train.loggers` (TensorBoard; wandb, which mirrors it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dpipe.config.schema import LoggerName
from dpipe.io import atomic_write_text
from dpipe.train.wandb_run import start_wandb


def _drop_steps_after(jsonl: Path, step: int) -> None:
    """Removes the lines of steps past `step`: a killed run logged them after the checkpoint that
    its resume starts from, and the resume logs them again. A line the kill cut short goes too."""
    if not jsonl.is_file():
        return
    kept, dropped = [], False
    for line in jsonl.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped = True
            continue
        if record.get("step", 0) > step:
            dropped = True
        else:
            kept.append(line + "\n")
    if dropped:  # atomically: a kill now leaves the old file or the new one, never a part
        atomic_write_text(jsonl, "".join(kept))


class _Discard:
    """TensorBoard's writer where train.loggers leaves it out."""

    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


class Reporter:
    def __init__(self, run_dir: Path, start_step: int, max_steps: int, samples_per_step: int,
                 progress_bar: bool, run=None):
        from tqdm import tqdm

        loggers = ({LoggerName(n) for n in run.train.loggers} if run is not None
                   else {LoggerName.tensorboard})
        # Before TensorBoard's writer: wandb mirrors it (dpipe.train.wandb_run).
        self.wandb = start_wandb(run, run_dir) if LoggerName.wandb in loggers else None
        # The writer that samples and evaluations log to (None: no TensorBoard); a resumed
        # run first drops what its killed predecessor logged past the checkpoint it resumes
        # from: TensorBoard then shows each step once.
        self.writer = None
        if LoggerName.tensorboard in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                        purge_step=start_step + 1 if start_step else None)
        self._scalars = self.writer or _Discard()
        # One JSON line per logged step: easy to read for scripts, sweep summaries and tests.
        jsonl = run_dir / "metrics.jsonl"
        _drop_steps_after(jsonl, start_step)  # as TensorBoard's purge_step: each step once
        self.jsonl = jsonl.open("a")
        self.samples_per_step = samples_per_step
        self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step",
                        disable=not progress_bar, dynamic_ncols=True)
        self.last, self.last_step = time.perf_counter(), start_step
        self.pending: dict = {}  # recorded with the next logged step
        self.pending_scalars: dict = {}  # TensorBoard scalars, the same

    def audit(self, step: int, host_syncs: int, backward_passes: float,
              peak_memory_gib: float | None = None) -> None:
        """The audited step's counts (dpipe.train.audit) and, on a GPU, the highest peak memory
        allocated on any rank in it."""
        self._scalars.add_scalar("perf/host_syncs", host_syncs, step)
        self._scalars.add_scalar("perf/backward_passes_per_micro_batch", backward_passes, step)
        self.pending.update(audited_step=step, host_syncs=host_syncs,
                            backward_passes_per_micro_batch=backward_passes)
        if peak_memory_gib is not None:
            self._scalars.add_scalar("perf/peak_memory_gib", peak_memory_gib, step)
            self.pending["peak_memory_gib"] = peak_memory_gib

    def scalars(self, values: dict[str, float]) -> None:
        """Values recorded with the next logged step, such as an optimizer's own estimates
        (dpipe.train.optim.logged_scalars): in TensorBoard under their names ("optim/prodigy_d")
        and in metrics.jsonl under the last part of the name ("prodigy_d")."""
        for name, value in values.items():
            self.pending_scalars[name] = value
            self.pending[name.rsplit("/", 1)[-1]] = value

    def pause(self, seconds: float) -> None:
        """Leaves `seconds` of work that is not training (counting FLOPs) out of the step time."""
        self.last += seconds

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None,
             flops_per_gpu: float | None = None) -> None:
        """Logs `step`; the times are per step since the last logged one (train.log_every), and
        `flops_per_gpu` the FLOPs executed per GPU in those steps (dpipe.train.flops)."""
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        steps, self.last_step = max(step - self.last_step, 1), step
        step_time = elapsed / steps
        samples_per_s = self.samples_per_step / step_time
        self._scalars.add_scalar("train/loss", loss, step)
        self._scalars.add_scalar("train/lr", lr, step)
        if grad_norm is not None:
            self._scalars.add_scalar("train/grad_norm", grad_norm, step)
        self._scalars.add_scalar("perf/step_time_s", step_time, step)
        self._scalars.add_scalar("perf/samples_per_s", samples_per_s, step)
        for name, value in self.pending_scalars.items():
            self._scalars.add_scalar(name, value, step)
        self.pending_scalars = {}
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "step_time_s": step_time, "samples_per_s": samples_per_s, **self.pending}
        shown = {"loss": f"{loss:.4f}", "samples_s": f"{samples_per_s:.2f}"}
        if flops_per_gpu is not None:
            tflops = flops_per_gpu / elapsed / 1e12
            self._scalars.add_scalar("perf/tflops_per_gpu", tflops, step)
            record["tflops_per_gpu"] = tflops
            shown["tflops"] = f"{tflops:.3g}"
        self.pending = {}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self._scalars.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
