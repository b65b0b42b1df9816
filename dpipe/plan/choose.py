"""The plan: stages, data-parallel replicas, split, base storage, recompute and block swap that fit
a machine and train fastest, with the GPU memory, host memory and cache disk each step needs.

Every layout of the machine's GPUs (1, 2, 4 or 8 stages, times up to as many data-parallel replicas
as the rest of the GPUs hold) and
base storage (bf16, or fp8 for a LoRA) is tried. Each stage's layers come from the engine's own
split (`dpipe.pipeline.partition`), and the runtime memory planner's own choice
(`dpipe.pipeline.memory.plan_swap`, from the footprint's figures instead of the first step's
measurements) says which layers recompute and which swap. Of the layouts that fit, the plan is
the one with the fewest estimated seconds per sample. A key the user set is a constraint: only
layouts that keep it are tried.

Estimates, not measurements: the step time comes from each layer's FLOPs at a GPU's typical rate
(`dpipe.plan.machine`), and the memory from the footprint (`dpipe.plan.footprint`); the run
records how far each was from what it used (`<run>/plan.json`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dpipe.config.schema import (Adapter, BaseCompute, OptimizerName, Precision, RunConfig,
                                 TrainMode)
from dpipe.pipeline.memory import (PROCESS_HOST, LayerCost, fragmentation_margin,
                                   in_flight_micro_batches, loading_bytes, plan_swap,
                                   read_layer_bytes)
from dpipe.pipeline.partition import stage_bounds
from dpipe.plan.footprint import ModelFootprint
from dpipe.plan.machine import GiB, HOST_TO_DEVICE, Machine, size

# Optimizer state in bytes per trained parameter (fp32 states; a bf16 full fine-tune without
# master weights keeps them in bf16, half of it).
OPTIMIZER_STATE = {OptimizerName.adamw: 8, OptimizerName.adamw8bit: 2,
                   OptimizerName.adafactor: 1, OptimizerName.came: 2, OptimizerName.prodigy: 16,
                   OptimizerName.schedulefree_adamw: 8, OptimizerName.muon: 4}
# An fp8-stored Linear dequantizes its weight on each use: a few % of its layer's time.
FP8_SLOWDOWN = 1.05
STAGE_COUNTS = (1, 2, 4, 8)
PLANNED_KEYS = ("pipeline.stages", "pipeline.data_parallel", "pipeline.split",
                "model.base_dtype", "pipeline.activation_checkpointing", "pipeline.blocks_to_swap",
                "pipeline.memory_budget_gb")


@dataclass(frozen=True)
class StagePlan:
    layers: tuple[int, int]  # [first, end) of the model's pipeline layers
    weights: int  # bytes of frozen weights on the device (swapped ones: the two in flight)
    trainable: int  # trained weights, gradients and optimizer state
    activations: int  # kept activations of the micro-batches in flight
    transient: int  # backward's buffers: one recomputed layer's activations
    recompute: int  # layers that recompute
    swap: int  # layers whose frozen weights stream from the host
    swapped_bytes: int  # their bytes, pinned on the host
    seconds: float  # per micro-batch, forward and backward
    planned: int  # what the run's memory plan reserves: its safety factor and margin included

    @property
    def peak(self) -> int:
        return self.weights + self.trainable + self.activations + self.transient


@dataclass(frozen=True)
class Plan:
    machine: Machine
    stages: int
    data_parallel: int
    # "bf16" / "fp32" (the training precision), "fp8" (8-bit weights by model.base_dtype=fp8),
    # "int8" (by model.base_compute=int8, which stores them so) or "8-bit file" (the file's own)
    base: str
    stage_plans: tuple[StagePlan, ...]
    budget: int  # bytes per GPU the plan keeps within
    micro_batches: int
    samples_per_step: int
    seconds_per_step: float
    host: dict[str, int]  # bytes of host memory per step of the run: loading, caching, training
    disk: int | None  # cache bytes for the dataset's files; None: the files are not known
    problems: tuple[str, ...] = field(default=())  # why it does not fit; empty: it fits

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def seconds_per_sample(self) -> float:
        return self.seconds_per_step / self.samples_per_step

    @property
    def split(self) -> list[int]:
        return [s.layers[0] for s in self.stage_plans[1:]]

    @property
    def host_peak(self) -> tuple[str, int]:
        step = max(self.host, key=self.host.get)
        return step, self.host[step]

    @property
    def overrides(self) -> list[str]:
        """The command-line keys that run this plan."""
        recompute = sum(s.recompute for s in self.stage_plans)
        swap = sum(s.swap for s in self.stage_plans)
        out = [f"pipeline.stages={self.stages}", f"pipeline.data_parallel={self.data_parallel}"]
        if self.base == "fp8":
            out.append("model.base_dtype=fp8")
        if recompute or swap:
            out += ["pipeline.activation_checkpointing=auto",
                    f"pipeline.memory_budget_gb={self.budget / GiB:.0f}"]
        if swap:
            out.append("pipeline.blocks_to_swap=auto")
        return out


def optimizer_bytes(run: RunConfig, trainable: int, trainable_bytes: int) -> int:
    """Trained weights, their gradients and the optimizer's state."""
    state = OPTIMIZER_STATE[run.optim.name]
    if run.model.mode == TrainMode.lora:
        return 2 * trainable_bytes + trainable * state  # weights and gradients as stored (fp32)
    if run.train.precision == Precision.bf16 and run.optim.master_weights:
        return trainable * (2 + 2 + 4 + 4 + state)  # bf16 weights, grads; fp32 master, grads
    if run.train.precision == Precision.bf16:
        return trainable * (2 + 2 + state // 2)
    return trainable * (4 + 4 + state)


def _stage(footprint: ModelFootprint, run: RunConfig, machine: Machine, first: int, end: int,
           index: int, stages: int, fp8: bool, budget: int, recompute: str, swap: str
           ) -> StagePlan:
    layers = footprint.layers[first:end]
    in_flight = in_flight_micro_batches(index, stages, run.pipeline.micro_batches)
    lora = run.model.mode == TrainMode.lora
    trainable = optimizer_bytes(run, sum(x.trainable for x in layers),
                                sum(x.trainable_bytes for x in layers))
    seconds = [x.flops / machine.flops * (FP8_SLOWDOWN if fp8 and x.quantizable else 1.0)
               for x in layers]
    frozen = [x.frozen(fp8) for x in layers]
    can_swap = lora and swap != "0"
    costs = {i: LayerCost(x.activations, seconds[i], frozen[i] if can_swap else 0,
                          frozen[i] / HOST_TO_DEVICE if can_swap else 0.0)
             for i, x in enumerate(layers)}
    base = trainable + (0 if can_swap else sum(frozen))
    planned = None
    if recompute == "none":
        chosen_recompute, chosen_swap = set(), set()
    elif recompute == "all":
        chosen_recompute, chosen_swap = set(costs), set()
    elif recompute.isdigit():
        chosen_recompute, chosen_swap = set(range(min(int(recompute), len(costs)))), set()
    else:  # auto: as the memory plan chooses at the run's first step
        chosen = plan_swap(costs, base, budget, in_flight)
        chosen_recompute, chosen_swap, planned = chosen.checkpointed, chosen.swapped, chosen.peak
    if swap.isdigit() and int(swap) and recompute != "auto":
        chosen_swap = set(sorted(costs)[:int(swap)])
    kept = sum(c.activations for i, c in costs.items() if i not in chosen_recompute)
    moved = sorted((frozen[i] for i in chosen_swap), reverse=True)
    on_device = sum(frozen) - sum(moved) + sum(moved[:2])
    largest = max((c.activations for c in costs.values()), default=0)
    per_micro_batch = sum(3 * s for s in seconds) + sum(seconds[i] for i in chosen_recompute) \
        + sum(costs[i].swap_s for i in chosen_swap)
    peak = on_device + trainable + in_flight * kept + largest
    return StagePlan((first, end), on_device, trainable, in_flight * kept, largest,
                     len(chosen_recompute), len(chosen_swap), sum(moved), per_micro_batch,
                     planned if planned is not None else peak + fragmentation_margin(budget))


def _host(footprint: ModelFootprint, run: RunConfig, stage_plans, processes: int,
          data_parallel: int, encoders: int | None) -> dict[str, int]:
    """Host memory of each step of a run on one machine: every worker reads its stage's weights
    where the family and the run allow (`dpipe.train.trainable.reads_stage_only`), else loads
    the whole denoiser in fp32 before keeping its stage; the cache is built with the encoders
    loaded; training pins the swapped weights of each stage of each replica."""
    from dpipe.train.trainable import reads_stage_only

    if footprint.stage_loading and reads_stage_only(run):
        out = {"loading the denoiser (each process its stage)": data_parallel * sum(
            stage_loading_bytes(footprint.layers[slice(*s.layers)], run) + PROCESS_HOST
            for s in stage_plans)}
    else:
        out = {"loading the denoiser (fp32, every process)":
               processes * (4 * footprint.params + PROCESS_HOST)}
    if encoders is not None:
        out["caching (encoders loaded)"] = encoders + PROCESS_HOST
    out["training (pinned swap buffers)"] = processes * PROCESS_HOST + data_parallel * sum(
        s.swapped_bytes for s in stage_plans)
    return out


def layout(footprint: ModelFootprint, run: RunConfig, machine: Machine, stages: int,
           data_parallel: int, fp8: bool, files: int | None = None,
           encoders: int | None = None) -> Plan:
    """One layout's plan (fitting or not), with the run's own checkpointing, swap and budget."""
    p = run.pipeline
    budget = int(min(machine.gpu_gib, p.memory_budget_gb or machine.gpu_gib) * GiB)
    bounds = stage_bounds([x.cost for x in footprint.layers], stages, p.partition, p.split)
    plans = tuple(_stage(footprint, run, machine, bounds[s], bounds[s + 1], s, stages, fp8,
                         budget, p.activation_checkpointing, str(p.blocks_to_swap))
                  for s in range(stages))
    slowest = max(s.seconds for s in plans)
    step = (p.micro_batches + stages - 1) * slowest
    samples = p.micro_batches * p.micro_batch_size * data_parallel
    host = _host(footprint, run, plans, stages * data_parallel, data_parallel, encoders)
    disk = None if files is None else files * (footprint.latent_bytes + footprint.text_bytes)
    base = (("8-bit file" if keeps_file_base(run) else eight_bit_base(run)) if fp8
            else "bf16" if run.train.precision == Precision.bf16 else "fp32")
    plan = Plan(machine, stages, data_parallel, base, plans, budget, p.micro_batches, samples,
                step, host, disk)
    return replace(plan, problems=tuple(problems(plan)))


def problems(plan: Plan) -> list[str]:
    out = []
    for i, s in enumerate(plan.stage_plans):
        need = s.planned
        if need > plan.budget:
            out.append(f"stage {i} needs {need / GiB:.1f} GiB of GPU memory, "
                       f"{plan.budget / GiB:.1f} GiB per GPU are free")
    step, need = plan.host_peak
    if need > plan.machine.host_gib * GiB:
        out.append(f"{step} needs {need / GiB:.0f} GiB of host memory, the host has "
                   f"{plan.machine.host_gib:.0f} GiB")
    if plan.disk is not None and plan.machine.disk_gib is not None \
            and plan.disk > plan.machine.disk_gib * GiB:
        out.append(f"the cache needs {size(plan.disk)}, the cache disk has "
                   f"{size(int(plan.machine.disk_gib * GiB))} free")
    return out


def eight_bit_base(run: RunConfig) -> str:
    """The plan's name for 8-bit base weights: model.base_compute's format where it is set
    (it stores the weights so, and no model.base_dtype key is needed), else fp8."""
    return "fp8" if run.model.base_compute == BaseCompute.auto else run.model.base_compute.value


def candidates(run: RunConfig, machine: Machine, fixed: set[str], world: int | None = None):
    """(stages, data_parallel, fp8) of every layout that keeps the keys in `fixed`; given
    `world`, the processes someone else started (torchrun, SLURM), only layouts of exactly that
    many."""
    p = run.pipeline
    gpus = max(machine.gpus, 1)
    counts = [p.stages] if "pipeline.stages" in fixed or "pipeline.split" in fixed \
        else [s for s in STAGE_COUNTS if s <= gpus]
    lora = run.model.mode == TrainMode.lora
    bases = ([True] if keeps_file_base(run) else
             [run.model.base_dtype.quantized] if "model.base_dtype" in fixed or not lora
             else [False, True])
    if lora and run.model.base_compute != BaseCompute.auto:
        bases = [True]  # 8-bit matmuls multiply 8-bit weights: the storage comes with them
    for stages in counts:
        # Fewer replicas than the GPUs hold too: each replica reads the denoiser again, so the
        # host's memory may not hold one per GPU.
        replicas = [p.data_parallel] if "pipeline.data_parallel" in fixed and p.data_parallel \
            else range(1, max(1, gpus // stages) + 1)
        for data_parallel in replicas:
            if world is not None and stages * data_parallel != world:
                continue
            for fp8 in bases:
                yield stages, data_parallel, fp8


def keeps_file_base(run: RunConfig) -> bool:
    """Whether the run's frozen base is a quantized single file's own 8-bit Linears (a LoRA on
    it with model.base_dtype at auto: dpipe.train.stored_base): 8 bits in every plan, with no
    model.base_dtype to set."""
    from pathlib import Path

    from dpipe.models.common.quantized_files import stores_8bit_linears
    from dpipe.models.single_file import keeps_stored_base

    path = Path(str(run.model.path)).expanduser()
    return keeps_stored_base(run.model) and path.is_file() and stores_8bit_linears(path)


def stored_value_bytes(run: RunConfig) -> float | None:
    """Bytes of a frozen Linear value as a worker reads the run's base, where a LoRA keeps a
    quantized file's Linears as the file stores them: 1 for an 8-bit file (`keeps_file_base`;
    its scales, < 0.1%, left out), a GGUF file's mean over its Linear weights
    (`gguf_files.stored_value_bytes`); None where the base is read as training keeps it (an fp8
    base is made from the values read)."""
    from pathlib import Path

    from dpipe.models.common.gguf_files import GGUF_SUFFIX
    from dpipe.models.common.gguf_files import stored_value_bytes as gguf_value_bytes

    if keeps_file_base(run):
        return 1.0
    path = Path(str(run.model.path)).expanduser()
    if run.model.mode == TrainMode.lora and path.suffix == GGUF_SUFFIX and path.is_file():
        return gguf_value_bytes(path)
    return None


def stage_loading_bytes(layers, run: RunConfig) -> int:
    """Host bytes a worker holds while it reads its stage's `layers` (each with its
    `frozen_bytes`, `quantizable` and `trainable_bytes`, as `LayerFootprint`): each layer as it
    is read (`read_layer_bytes`: where a LoRA keeps a quantized file's Linears as stored, at
    their stored bytes), and in transit the largest layer or, from a quantized safetensors
    file, a batch of its tensors dequantized in fp32 (`single_file_weights.BATCH_BYTES`),
    whichever is more (`loading_bytes`)."""
    from pathlib import Path

    from dpipe.models.common.quantized_files import file_is_quantized
    from dpipe.models.single_file_weights import BATCH_BYTES

    value_bytes = stored_value_bytes(run)
    bf16 = run.train.precision == Precision.bf16
    # A bf16 DoRA reads its base in fp32 (its magnitudes are the fp32 base's norms), then casts.
    widen = 2 if bf16 and run.model.mode == TrainMode.lora and run.model.adapter == Adapter.dora \
        else 1
    base_bytes = (2 if bf16 else 4) * widen  # a frozen value as read
    sizes = [read_layer_bytes(x.frozen_bytes * widen, x.quantizable, x.trainable_bytes,
                              value_bytes, base_bytes) for x in layers]
    path = Path(str(run.model.path)).expanduser()
    dequantized = path.is_file() and file_is_quantized(path)
    return loading_bytes(sizes, BATCH_BYTES if dequantized else 0)


def choose(footprint: ModelFootprint, run: RunConfig, machine: Machine,
           fixed: set[str] = frozenset(), files: int | None = None,
           encoders: int | None = None, world: int | None = None) -> Plan:
    """The fastest layout that fits, else the layout that comes closest (its `problems` say
    why). Keys not in `fixed` are the planner's to choose: checkpointing and block swap "auto"
    unless fixed. Given `world` (the processes torchrun or SLURM started), a layout of exactly
    that many processes."""
    free = {}
    if "pipeline.activation_checkpointing" not in fixed:
        free["activation_checkpointing"] = "auto"
    if "pipeline.blocks_to_swap" not in fixed and run.model.mode == TrainMode.lora:
        free["blocks_to_swap"] = "auto"
    if "pipeline.split" not in fixed:
        from dpipe.config.schema import PartitionMethod

        free["partition"] = PartitionMethod.balanced
    planned = replace(run, pipeline=replace(run.pipeline, **free))
    plans = [layout(footprint, planned, machine, s, d, fp8, files, encoders)
             for s, d, fp8 in candidates(planned, machine, fixed, world)]
    fitting = [p for p in plans if p.fits]
    if fitting:
        return min(fitting, key=lambda p: (p.seconds_per_sample, p.stages, p.base == "fp8"))
    return min(plans, key=lambda p: max(s.peak for s in p.stage_plans))

