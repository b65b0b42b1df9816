"""The training job of one rank: model-agnostic, it sees a model only through its `ModelSpec`."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dpipe.config.schema import Precision, RunConfig, TrainMode
from dpipe.data import prepare
from dpipe.data.batches import step_micro_batches
from dpipe.data.evaluate import Evaluator
from dpipe.data.loader import StepLoader, default_workers
from dpipe.models.stage_weights import DenoiserSkeleton
from dpipe.models.registry import build_spec
from dpipe.pipeline.engine import quiet_deepspeed, stage_of, start_rank
from dpipe.pipeline.memory import AutoCheckpointing, GiB, budget_bytes
from dpipe.sample.requests import sample_requests
from dpipe.sample.training import TrainingSamples
from dpipe.train import checkpoint, gpu_memory, plan_file, preemption
from dpipe.train.audit import StepAudit
from dpipe.train.divergence import diverged, not_finite
from dpipe.train.ema import WeightAverage
from dpipe.train.placement import node_name, placement
from dpipe.train.prior import PriorTargets
from dpipe.train.export import export, export_dir
from dpipe.train.optim import evaluation_weights, logged_scalars
from dpipe.train.engine_setup import apply_optim_config, build_training_engine
from dpipe.train.flops import StepFlops, architecture
from dpipe.train.trainable import load_denoiser, trainable_layers

log = logging.getLogger("dpipe")


def run_training(run: RunConfig, run_dir: Path) -> Path | None:
    """Trains on this rank (RANK/WORLD_SIZE/MASTER_* already set). Returns the export on rank 0."""
    device = start_rank(run)
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    data_parallel = world // run.pipeline.stages
    lora = run.model.mode == TrainMode.lora
    bf16 = run.train.precision == Precision.bf16

    spec = build_spec(run.model)
    spec.use_loss(run.train)
    if rank == 0:
        spec.ensure_available()  # may create the tiny model once, for every rank
    dist.barrier()
    spec.ensure_available()

    cache_dtype = torch.bfloat16 if bf16 and cuda else torch.float32
    requests = sample_requests(run.sample, spec, run.dataset)  # their prompts are cached too
    dataset = prepare.prepare(spec, run.dataset, device, cache_dtype,
                              prepare.Layout.of(run, data_parallel), run_dir,
                              sample_requests=requests)
    plan = dataset.plan

    stage = stage_of(rank, run.pipeline.stages, data_parallel)
    denoiser = load_denoiser(spec, run, stage)  # or its skeleton: this stage's weights only
    model = getattr(denoiser, "model", denoiser)
    step_flops = StepFlops(spec, run, architecture(model)) if rank == 0 else None
    layers = trainable_layers(spec, run, denoiser, stage)
    stage_only = isinstance(denoiser, DenoiserSkeleton)
    del denoiser, model  # the layers hold their own parts; a stage keeps only its layers
    with quiet_deepspeed():
        built = build_training_engine(layers, spec, run, data_parallel)
    assert built.stage == stage, "the engine placed this rank on another stage than it loaded"
    engine = built.engine
    plan_file.record_start(run_dir, list(engine.module.forward_funcs), layers, stage_only)
    dp_rank = engine.grid.get_data_parallel_rank()
    where = [None] * world  # which node holds which stage, for the log (a collective)
    dist.all_gather_object(where, (built.stage, node_name()))
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(run))

    step = 0
    resumed = (checkpoint.agreed_resume(run_dir, run.train.resume_unverified)
               if run.train.resume else None)
    if resumed is not None:
        step = checkpoint.load(engine, run_dir, resumed[1], lora)
        apply_optim_config(engine, run)  # the changes check_resume logged take effect now
    ema = None
    if run.train.ema.decay:  # after the load: a checkpoint without an EMA starts it from there
        ema = WeightAverage(engine.module, run.train.ema, built.stage, writes=dp_rank == 0)
        if resumed is not None:
            ema.resume(resumed[1], step, logs=rank == 0)
    prepare.resume_plan(dataset, step, run_dir)  # the data order continues exactly; logs changes
    if rank == 0:
        _summary(run, built, plan, len(layers), world, resumed)
        log.info("stages on nodes: %s", placement(where))

    reporter = None
    if rank == 0:
        from dpipe.train.metrics import Reporter

        reporter = Reporter(run_dir, step, run.train.max_steps, plan.global_batch,
                            run.train.progress_bar, run)
    last_save_time, last_saved = time.monotonic(), step
    auto_ckpt = None
    if run.pipeline.activation_checkpointing == "auto" and cuda:
        auto_ckpt = AutoCheckpointing(engine.module, built.stage, run.pipeline.stages,
                                      run.pipeline.micro_batches, run.pipeline.memory_budget_gb)
    evaluator = Evaluator(spec, dataset, run.dataset.eval, run.train.timesteps, data_parallel,
                          dp_rank, run.train.seed, run_dir)
    # Our optimizer (DeepSpeed's wrappers keep it as the scheduler's): schedule-free AdamW's
    # averaged weights are what evaluation, samples and exports see (evaluation_weights).
    optimizer = engine.lr_scheduler.optimizer
    # A resumed run skips the eval of its first step (it ran before the checkpoint).
    with _evaluating(optimizer, evaluator.due(step) and step == 0):
        evaluator.maybe_run(engine, step, reporter)
    if _step_export_due(run, step) and _missing(export_dir(run_dir, lora, step)):
        # Killed between the checkpoint it resumes from and that step's export: made now.
        with evaluation_weights(optimizer):
            export(list(engine.module.forward_funcs), spec, lora, run_dir, built.stage,
                   run.pipeline.stages, dp_rank, step=step, keep=run.train.keep_exports, ema=ema)
    samples = TrainingSamples(spec, run, requests, run_dir, dataset, engine, device, cache_dtype)
    if samples.missing(step):  # sample.at_start, or a round that a killed run did not finish
        with evaluation_weights(optimizer), _sampling_ema(ema, run):
            samples.run(step, getattr(reporter, "writer", None))

    def make_step(at: int, records: list | None):
        return step_micro_batches(spec, dataset, plan, run.train.timesteps, run.train.seed, at,
                                  dp_rank, records)

    # Prior preservation (a directory's prior_preservation): the base model's prediction as the
    # target of those files, made before each step that holds one.
    priors = (PriorTargets(spec, engine, plan, dp_rank)
              if any(s.prior for b in plan.manifest.buckets for s in b.samples) else None)
    workers = run.train.loader_workers
    loader = StepLoader(make_step, step, run.train.max_steps,
                        default_workers(cuda) if workers is None else workers, device,
                        dataset.write_record if dataset.log is not None else None)
    while step < run.train.max_steps:
        # Dropout and other module randomness: the same at step k whether or not the run resumed.
        torch.manual_seed(run.train.seed * 100_003 + step * 1_009 + rank)
        audit = StepAudit() if step + 1 == run.train.audit_step else None
        if audit is not None and cuda:
            torch.cuda.reset_peak_memory_stats()  # the audited step's own peak
        micro_batches = loader.next(step)
        if priors is not None:
            micro_batches = priors.retarget(step, micro_batches)
        if step_flops is not None:  # rank 0
            micro_batches = step_flops.watch(micro_batches)
        if audit is not None:
            micro_batches = audit.made_on_host(micro_batches)
        with audit.counting() if audit else contextlib.nullcontext():
            loss = engine.train_batch(data_iter=micro_batches)
        step += 1
        if ema is not None and ema.due(step):
            ema.update()
        if step_flops is not None:
            # A new shape takes seconds to count: left out of the step times. Lookups do not.
            with _not_training(reporter, cuda) if step_flops.new_shapes() \
                    else contextlib.nullcontext():
                step_flops.count_watched()
        if audit is not None:
            _report_audit(audit, step, run.pipeline, built.stage, device, reporter)
        with _evaluating(optimizer, evaluator.due(step)):
            evaluator.maybe_run(engine, step, reporter)
        if auto_ckpt is not None:
            auto_ckpt.after_first_step()
            auto_ckpt = None
        logged = step % run.train.log_every == 0 or step == run.train.max_steps
        due = _checkpoint_due(run, step, last_saved, last_save_time)
        if logged or due:  # read the step's loss and norm (host syncs) at these steps only
            step_loss, grad_norm = float(loss), engine.get_global_grad_norm()
            grad_norm = None if grad_norm is None else float(grad_norm)
            if reporter is not None and logged:
                # Rank 0's micro-batches stand for every data-parallel rank's (one bucket).
                flops = step_flops.take()
                reporter.scalars(logged_scalars(optimizer, run.optim))  # Prodigy's d
                reporter.step(step, step_loss, engine.get_lr()[0], grad_norm,
                              None if flops is None else flops * data_parallel / world)
            problem = not_finite(step_loss, grad_norm)
            if problem is not None:  # every rank sees the same (dpipe.train.divergence)
                loader.close()
                if reporter is not None:
                    reporter.close()
                raise diverged(problem, step, run, run_dir)
        if due:
            checkpoint.save(engine, run_dir, step, config_yaml, lora, run.train.keep_checkpoints,
                            extra=ema)
            last_save_time, last_saved = time.monotonic(), step
        if _step_export_due(run, step):
            # Synchronous, like a checkpoint: training waits for the write, and no longer.
            with evaluation_weights(optimizer):
                export([f for f in engine.module.forward_funcs], spec, lora, run_dir,
                       built.stage, run.pipeline.stages, dp_rank, step=step,
                       keep=run.train.keep_exports, ema=ema)
        if step < run.train.max_steps and samples.due(step):  # the last step's: after its checkpoint
            with _not_training(reporter, cuda) if reporter else contextlib.nullcontext(), \
                    evaluation_weights(optimizer), _sampling_ema(ema, run):
                samples.run(step, reporter.writer if reporter else None)
        if preemption.stop_agreed() and step < run.train.max_steps:
            loader.close()
            if preemption.requeues():
                preemption.requeue_and_exit(step)  # SLURM's time-limit signal: saved above; exits
            # A user's stop (SIGINT/SIGTERM to the local launcher): saved above; the launcher
            # says where. No export: the run is not finished, and resumes from this checkpoint.
            if reporter is not None:
                reporter.close()
            dist.barrier()
            return None
    loader.close()
    if step != last_saved:
        checkpoint.save(engine, run_dir, step, config_yaml, lora, run.train.keep_checkpoints,
                        extra=ema)
    # The last checkpoint is saved: from here on the model holds the weights to keep.
    with evaluation_weights(optimizer):
        if samples.missing(step):  # the final round (a finished run that is run again has it)
            with _sampling_ema(ema, run):
                samples.run(step, getattr(reporter, "writer", None))
        if reporter is not None:
            reporter.close()

        local_layers = [f for f in engine.module.forward_funcs]
        out = export(local_layers, spec, lora, run_dir, built.stage, run.pipeline.stages,
                     dp_rank, ema=ema)
    if rank == 0:
        log.info("exported %s", out)
    compared = plan_file.record_end(run_dir, built.stage, Path(run.dataset.cache_dir).expanduser())
    if compared is not None:
        log.info(compared)
    dist.barrier()
    return out


def _sampling_ema(ema: WeightAverage | None, run: RunConfig):
    """The EMA's weights in the model for a sample round with sample.ema=true (the checks
    refuse sample.ema without an EMA)."""
    return ema.swapped_in() if ema is not None and run.sample.ema else contextlib.nullcontext()


def _evaluating(optimizer, due: bool):
    """evaluation_weights around an eval that runs: a swap for nothing would cost a copy."""
    return evaluation_weights(optimizer) if due else contextlib.nullcontext()


@contextlib.contextmanager
def _not_training(reporter, cuda: bool):
    """Host work between steps that rank 0's step times leave out. The GPU finishes the step
    first (a host sync, so for rare work only): the time it still needed stays in."""
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    try:
        yield
    finally:
        reporter.pause(time.perf_counter() - started)


def _report_audit(audit: StepAudit, step: int, pipeline, stage: int, device, reporter) -> None:
    """The audited step's worst rank and each stage's peak GPU memory, recorded by rank 0 (a
    collective: every rank calls it)."""
    cuda = device.type == "cuda"
    peak = torch.cuda.max_memory_allocated() / GiB if cuda else 0.0
    mine = torch.tensor([audit.host_syncs, audit.backward_passes, peak, stage],
                        dtype=torch.float64, device=device)
    ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(ranks, mine)
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, audit.worst())  # where each rank synced, logged by rank 0
    if reporter is None:
        return
    rows = torch.stack(ranks).cpu()
    host_syncs, passes = int(rows[:, 0].max()), float(rows[:, 1].max()) / pipeline.micro_batches
    peaks = gpu_memory.stage_peaks(rows[:, 3].long().tolist(), rows[:, 2].tolist())
    reporter.audit(step, host_syncs, passes, max(peaks) if cuda else None)
    log.info("step %d: %d host syncs%s, %g backward passes per micro-batch (the most on any "
             "rank)", step, host_syncs, "" if cuda else " (operations that sync on a GPU)",
             passes)
    for rank, where in enumerate(lines):
        if where:
            log.info("step %d's host syncs on rank %d: %s", step, rank, where)
    if not cuda:
        return
    if host_syncs:
        log.warning("step %d made %d host syncs: each one stops the host until the GPU is idle, "
                    "and the GPU then waits for new work (docs/performance.md, 'Host syncs')",
                    step, host_syncs)
    budget = budget_bytes(pipeline.memory_budget_gb) / GiB
    log.info("step %d: peak GPU memory by stage: %s GiB (budget %.1f GiB per GPU)", step,
             " / ".join(f"{p:.1f}" for p in peaks), budget)
    hint = gpu_memory.one_gpu_hint(peaks, budget)
    if hint is not None:
        log.warning(hint)


def _checkpoint_due(run: RunConfig, step: int, last_saved: int, last_time: float) -> bool:
    t = run.train
    if step == last_saved:
        return False
    by_steps = t.checkpoint_every_steps and step % t.checkpoint_every_steps == 0
    # Every rank must agree, or the collective save would hang: rank 0's clock decides the timed
    # checkpoints, and a time-limit signal on any rank stops them all (one all-reduce).
    time_due = bool(t.checkpoint_every_minutes) and (
        time.monotonic() - last_time >= 60 * t.checkpoint_every_minutes)
    by_time, stop = preemption.agree(time_due, bool(t.checkpoint_every_minutes))
    return bool(by_steps or by_time or stop)


def _missing(path: Path) -> bool:
    """Whether `path` is absent, as rank 0 sees it (a collective: every rank gets its answer)."""
    answer = [not path.exists()]
    dist.broadcast_object_list(answer, src=0)
    return answer[0]


def _step_export_due(run: RunConfig, step: int) -> bool:
    """An intermediate export (`<run>/lora/step_<N>/`) at this step; the last step has the final
    export. Every rank computes the same answer (the export is collective)."""
    every = run.train.export_every_steps
    return bool(every and step and step % every == 0 and step < run.train.max_steps)


def _summary(run, built, plan, num_layers, world, resumed) -> None:
    bounds = built.bounds
    stages = ", ".join(f"stage {i}: layers {bounds[i]}-{bounds[i + 1] - 1}"
                       for i in range(len(bounds) - 1))
    log.info("model %s (%s), %d pipeline layers; %s", run.model.family, run.model.mode.value,
             num_layers, stages)
    log.info("%d processes = %d stages x %d data-parallel; %d samples per step "
             "(%d micro-batches of %d); %d steps per epoch, %d items left over per epoch",
             world, run.pipeline.stages, world // run.pipeline.stages, plan.global_batch,
             plan.micro_batches, plan.micro_batch_size, plan.steps_per_epoch,
             plan.left_over_per_epoch)
    if resumed is not None:
        log.info("resumed from %s (step %d)", resumed[1], resumed[0])
