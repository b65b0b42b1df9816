"""One rank of a benchmark: the real layers, engine and train_batch, on a real-size model with
random weights and random (fixed) micro-batches. `python -m dpipe.bench.worker DIR`."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dpipe.config.schema import Precision, TimestepConfig, TrainMode
from dpipe.diffusion.timesteps import sample_timesteps
from dpipe.launch.run_rank import RUN_CONFIG, load_run_config, setup_logging
from dpipe.models.registry import build_spec
from dpipe.pipeline.engine import init_distributed, quiet_deepspeed
from dpipe.pipeline.memory import AutoCheckpointing
from dpipe.pipeline.attention import use_sdpa_kernels
from dpipe.train.engine_setup import build_training_engine
from dpipe.train.flops import StepFlops, architecture, shapes_of


def require_size(spec, size: str) -> None:
    """Exits with a message naming the family's benchmark sizes when `size` is not one."""
    if size not in spec.bench_sizes():
        known = ", ".join(spec.bench_sizes()) or "none yet (a family gets them from " \
                                                  "ModelSpec.bench_configs)"
        raise SystemExit(f"error: --size {size}: model family {spec.family} has no benchmark "
                         f"config of that size; its sizes: {known}")


def random_audio(spec, size: str, count: int) -> torch.Tensor | None:
    """`count` samples' random audio latents where the run trains sound (model.audio=true):
    every clip has its soundtrack, as in a dataset of clips with sound."""
    if not spec.cfg.audio:
        return None
    return torch.stack([spec.random_audio(size) for _ in range(count)])


def fixed_micro_batches(spec, size: str, micro_batches: int, micro_batch_size: int, seed: int):
    """The step's micro-batches, made once: timing the model, not random number generation."""
    from dpipe.data.batches import DataBatch, noised_audio

    torch.manual_seed(seed)  # the same on the first and the last stage
    batches = []
    for micro in range(micro_batches):
        samples = [spec.random_sample(size) for _ in range(micro_batch_size)]
        latents = torch.stack([s[0] for s in samples])
        text = {k: torch.stack([s[1][k] for s in samples]) for k in samples[0][1]}
        noise = torch.randn(latents.shape)
        t = sample_timesteps(TimestepConfig(), len(latents), torch.Generator().manual_seed(micro))
        noisy, target = spec.noise(latents, noise, t)
        audio = random_audio(spec, size, len(latents))
        sound = {} if audio is None else noised_audio(spec, audio, t, seed, 0, range(
            micro * micro_batch_size, (micro + 1) * micro_batch_size))
        inputs, labels = spec.make_inputs(DataBatch(latents=latents, noise=noise, timesteps=t,
                                                    noisy=noisy, target=target, text=text,
                                                    **sound))
        pin = lambda ts: tuple(t.pin_memory() if torch.cuda.is_available() else t for t in ts)
        batches.append((pin(inputs), pin(labels)))
    return batches


def loader_steps(spec, size: str, micro_batches: int, micro_batch_size: int, seed: int,
                 cache_dir: Path):
    """`make_step` for the training loader: fixed random latents and text embeddings, written
    once to a cache store in `cache_dir` and read back (checksums verified) each step as
    training reads its cache, with each step's noise and timesteps drawn as training draws them
    (`noised_batch`, seeded by step and slot) and packed by the model's `make_inputs`."""
    from dpipe.data.batches import noised_batch
    from dpipe.data.cache_store import TensorStore, cache_key

    torch.manual_seed(seed)
    store = TensorStore(cache_dir)
    keys = []  # per micro-batch: (latent key, text key) of each sample
    for micro in range(micro_batches):
        keys.append([])
        for slot in range(micro_batch_size):
            latent, text = spec.random_sample(size)
            pair = (cache_key(bench=size, micro=micro, slot=slot, kind="latents"),
                    cache_key(bench=size, micro=micro, slot=slot, kind="text"))
            store.put(pair[0], {"latents": latent})
            store.put(pair[1], text)
            keys[-1].append(pair)
    sounds = [random_audio(spec, size, micro_batch_size) for _ in range(micro_batches)]

    def make_step(step: int, records):
        for micro, (group, audio) in enumerate(zip(keys, sounds)):
            latents = torch.stack([store.get(k)["latents"] for k, _ in group])
            embeds = [store.get(k) for _, k in group]
            text = {k: torch.stack([e[k] for e in embeds]) for k in embeds[0]}
            slots = range(micro * micro_batch_size, (micro + 1) * micro_batch_size)
            yield spec.make_inputs(noised_batch(spec, latents, text, TimestepConfig(), seed, step,
                                                slots, audio=audio))
    return make_step


def main() -> int:
    from dpipe.train.audit import StepAudit
    from dpipe.bench.timing import StageTiming
    from dpipe.train.trainable import trainable_layers

    bench_dir = Path(sys.argv[1])
    opts = json.loads((bench_dir / "bench.json").read_text())
    run = load_run_config(bench_dir / RUN_CONFIG)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    setup_logging(rank)
    cuda = torch.cuda.is_available()  # without: a CPU smoke test of this very path (no timings)
    if cuda:
        torch.cuda.set_device(local_rank)
        use_sdpa_kernels(run.model, run.pipeline.compiles)  # as in training (dpipe/train/loop.py)
    init_distributed("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    spec = build_spec(run.model).for_benchmark(opts["size"])
    bf16 = run.train.precision == Precision.bf16
    full = run.model.mode == TrainMode.full
    denoiser = spec.random_denoiser(opts["size"], torch.bfloat16 if bf16 else torch.float32, device)
    layers = trainable_layers(spec, run, denoiser)
    batches = fixed_micro_batches(spec, opts["size"], run.pipeline.micro_batches,
                                  run.pipeline.micro_batch_size, run.train.seed)
    flops_per_step = sum(spec.train_flops(denoiser, inputs, full) for inputs, _ in batches)
    data_parallel = dist.get_world_size() // run.pipeline.stages
    flops_per_step *= data_parallel
    executed_flops_per_step = None  # rank 0's figure is the one reported
    if rank == 0:
        executed = StepFlops(spec, run, architecture(denoiser)).of(shapes_of(*b) for b in batches)
        executed_flops_per_step = None if executed is None else data_parallel * executed
    if cuda and opts.get("memory_cap_gb"):
        # A smaller card, emulated from here on: allocations past the cap fail. The random model
        # is made on the GPU in fp32 first; training loads it on the CPU and converts it there.
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(local_rank).total_memory
        torch.cuda.set_per_process_memory_fraction(opts["memory_cap_gb"] * 2**30 / total)
    with quiet_deepspeed():
        built = build_training_engine(layers, spec, run, data_parallel)
    engine = built.engine
    auto = None
    if run.pipeline.activation_checkpointing == "auto" and cuda:
        auto = AutoCheckpointing(engine.module, built.stage, run.pipeline.stages,
                                 run.pipeline.micro_batches, run.pipeline.memory_budget_gb)
    if cuda:
        # On the device once, as the training loader hands DeepSpeed its micro-batches
        # (dpipe.data.loader): DeepSpeed clones host tensors before copying them (the clone is
        # not pinned), a host sync per tensor per micro-batch that training does not make (the
        # 64 per step counted in FLUX.1-dev benchmarks before 2026-12-06).
        batches = [tuple(tuple(t.to(device) for t in part) for part in b) for b in batches]
    data = lambda step: iter(batches)  # noqa: E731
    loader = None
    if opts.get("loader"):
        from dpipe.data.loader import StepLoader, default_workers

        workers = run.train.loader_workers
        loader = StepLoader(
            loader_steps(spec, opts["size"], run.pipeline.micro_batches,
                         run.pipeline.micro_batch_size, run.train.seed,
                         bench_dir / f"cache-rank{rank}"),
            0, opts["warmup"] + opts["steps"] + int(bool(opts.get("profile"))),
            default_workers(cuda) if workers is None else workers, device)
        data = loader.next
    timing = StageTiming(engine) if cuda else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step_s, work, audits, losses = [], [], [], []
    for step in range(opts["warmup"] + opts["steps"]):
        if step == opts["warmup"] and cuda:
            torch.cuda.reset_peak_memory_stats()
        audit = StepAudit()
        sync()
        start = time.perf_counter()
        with audit.counting():
            # The step's mean loss, left on the GPU: read after the timed steps, not per step.
            losses.append(engine.train_batch(data_iter=audit.made_on_host(data(step))).detach())
        sync()
        elapsed = time.perf_counter() - start
        spans = timing.collect() if cuda else {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        if auto is not None:
            auto.after_first_step()
            auto = None
        if step >= opts["warmup"]:
            step_s.append(elapsed)
            work.append(spans)
            audits.append(audit)
        if rank == 0:
            print(f"[bench] step {step} {elapsed:.3f}s {spans} host syncs {audit.host_syncs} "
                  f"backward passes {audit.backward_passes}", flush=True)
        if audit.host_syncs and step == opts["warmup"]:
            print(f"[bench] rank {rank} step {step} host syncs: {audit.worst(8)}", flush=True)
    result = {
        "rank": rank,
        # Every step's, warm-up included: a kernel that trains to NaN shows here (DeepSpeed
        # broadcasts the last stage's loss to the other stages).
        "losses": [float(loss) for loss in losses],
        "stage": built.stage,
        "layers": [built.bounds[built.stage], built.bounds[built.stage + 1]],
        "step_s": statistics.median(step_s),
        "forward_ms": statistics.median(w["forward"] for w in work),
        "backward_ms": statistics.median(w["backward"] for w in work),
        "optimizer_ms": statistics.median(w["optimizer"] for w in work),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        "flops_per_step": flops_per_step,
        "executed_flops_per_step": executed_flops_per_step,
        "images_per_step": run.pipeline.micro_batch_size * run.pipeline.micro_batches * data_parallel,
        "checkpointed_layers": len(engine.module.checkpointed),
        "local_layers": len(engine.module.forward_funcs),
        "host_syncs_per_step": max(a.host_syncs for a in audits),
        "backward_passes_per_micro_batch": max(a.backward_passes for a in audits)
        / run.pipeline.micro_batches,
    }
    (bench_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if opts.get("profile"):  # one more step, out of the figures written above
        from dpipe.bench.profile import profiled_step

        last = opts["warmup"] + opts["steps"]
        profiled_step(lambda: engine.train_batch(data_iter=data(last)),
                      bench_dir / f"profile_rank{rank}.txt", cuda)
    if loader is not None:
        loader.close()
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
