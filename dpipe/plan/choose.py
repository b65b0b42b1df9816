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
# Bytes a value of a GGUF Linear's weight takes while its matmul dequantizes it (in fp32, then
# cast to the compute dtype: `gguf_files.dequantize`): measured on the CPU (the high-water mark
# of the process) at 3072x12288, the cast's output included: Q8_0 8.1, Q4_K 9.4, Q5_K and Q6_K
# 11.4 (2026-12-08).
GGUF_DEQUANTIZE_BYTES = 12
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
    loading: int = 0  # host bytes its worker holds while reading (`process_loading_bytes`)

    @property
    def peak(self) -> int:
        return self.weights + self.trainable + self.activations + self.transient


@dataclass(frozen=True)
class Plan:
    machine: Machine
    stages: int
    data_parallel: int
    base: str  # `BaseStorage.name`
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
    def loading_per_process(self) -> list[int]:
        """Each process's host bytes while it reads the denoiser, in rank order: its stage's."""
        from dpipe.pipeline.engine import stage_of

        return [self.stage_plans[stage_of(rank, self.stages, self.data_parallel)].loading
                for rank in range(self.stages * self.data_parallel)]

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


@dataclass(frozen=True)
class BaseStorage:
    """How a LoRA run keeps the frozen Linear weights of the denoiser's blocks (the footprint's
    `quantizable` values), on the GPU and as a worker reads them: one description for both."""
    # As the plan prints it: "bf16" / "fp32" (the training precision), "fp8" / "int8" (8-bit
    # weights by model.base_dtype, or by model.base_compute, which stores them so), "8-bit
    # file" (a quantized file's own), "GGUF file" (its blocks)
    name: str
    base_bytes: int  # a frozen value in the training precision: 2 in bf16, 4 in fp32
    eight_bit: bool  # 1 byte a value and an fp32 scale a row (`dpipe.train.fp8.QuantizedLinear`)
    file_bytes: float | None  # bytes a value as the file stores it, kept so; None: not a file's
    dequantize_bytes: float  # a value of the weight a matmul dequantizes, while it multiplies

    @property
    def from_file(self) -> bool:
        """Whether a worker reads the Linears as kept (a file's own), not in the base dtype
        (the run quantizes its own 8-bit base after reading the stage)."""
        return self.file_bytes is not None

    def kept_bytes(self, x, widen: int = 1) -> int:
        """Layer `x`'s frozen bytes with its block Linears kept so (`widen`: 2 where a bf16
        base is read in fp32 first, a DoRA's)."""
        value = self.file_bytes
        if self.eight_bit:
            value = 1 + 4 * x.quantizable_rows / x.quantizable if x.quantizable else 1.0
        return read_layer_bytes(x.frozen_bytes * widen, x.quantizable, 0, value,
                                self.base_bytes * widen)

    def transient(self, layers) -> int:
        """What the largest Linear's dequantized weight adds while it multiplies."""
        return int(self.dequantize_bytes * max((x.largest_linear for x in layers), default=0))


def base_storage(run: RunConfig, eight_bit: bool) -> BaseStorage:
    """The run's `BaseStorage`: a GGUF file's blocks and a quantized file's 8-bit Linears as the
    file stores them (a LoRA on it: `stored_value_bytes`), else 8-bit (`eight_bit`: by
    model.base_dtype or model.base_compute) or the training precision."""
    base_bytes = 2 if run.train.precision == Precision.bf16 else 4
    stored = stored_value_bytes(run)
    if stored is not None and not keeps_file_base(run):  # a GGUF file
        return BaseStorage("GGUF file", base_bytes, False, stored,
                           GGUF_DEQUANTIZE_BYTES)
    if stored is not None or eight_bit:  # the matmul casts the 8-bit weight to compute
        return BaseStorage("8-bit file" if stored is not None else eight_bit_base(run),
                           base_bytes, True, stored, base_bytes)
    return BaseStorage("bf16" if base_bytes == 2 else "fp32", base_bytes, False, None, 0)


def _stage(footprint: ModelFootprint, run: RunConfig, machine: Machine, first: int, end: int,
           index: int, stages: int, storage: BaseStorage, budget: int, recompute: str,
           swap: str) -> StagePlan:
    layers = footprint.layers[first:end]
    in_flight = in_flight_micro_batches(index, stages, run.pipeline.micro_batches)
    lora = run.model.mode == TrainMode.lora
    trainable = optimizer_bytes(run, sum(x.trainable for x in layers),
                                sum(x.trainable_bytes for x in layers))
    dequantizes = storage.dequantize_bytes > 0
    seconds = [x.flops / machine.flops * (FP8_SLOWDOWN if dequantizes and x.quantizable
                                          else 1.0) for x in layers]
    frozen = [storage.kept_bytes(x) for x in layers]
    can_swap = lora and swap != "0"
    costs = {i: LayerCost(x.activations, seconds[i], frozen[i] if can_swap else 0,
                          frozen[i] / HOST_TO_DEVICE if can_swap else 0.0)
             for i, x in enumerate(layers)}
    base = trainable + (0 if can_swap else sum(frozen))
    # Backward's buffers: one recomputed layer's activations, and a dequantized weight.
    transient = max((c.activations for c in costs.values()), default=0) \
        + storage.transient(layers)
    planned = None
    if recompute == "none":
        chosen_recompute, chosen_swap = set(), set()
    elif recompute == "all":
        chosen_recompute, chosen_swap = set(costs), set()
    elif recompute.isdigit():
        chosen_recompute, chosen_swap = set(range(min(int(recompute), len(costs)))), set()
    else:  # auto: as the memory plan chooses at the run's first step
        chosen = plan_swap(costs, base, budget, in_flight, transient)
        chosen_recompute, chosen_swap, planned = chosen.checkpointed, chosen.swapped, chosen.peak
    if swap.isdigit() and int(swap) and recompute != "auto":
        chosen_swap = set(sorted(costs)[:int(swap)])
    kept = sum(c.activations for i, c in costs.items() if i not in chosen_recompute)
    moved = sorted((frozen[i] for i in chosen_swap), reverse=True)
    on_device = sum(frozen) - sum(moved) + sum(moved[:2])
    per_micro_batch = sum(3 * s for s in seconds) + sum(seconds[i] for i in chosen_recompute) \
        + sum(costs[i].swap_s for i in chosen_swap)
    peak = on_device + trainable + in_flight * kept + transient
    return StagePlan((first, end), on_device, trainable, in_flight * kept, transient,
                     len(chosen_recompute), len(chosen_swap), sum(moved), per_micro_batch,
                     planned if planned is not None else peak + fragmentation_margin(budget),
                     process_loading_bytes(footprint, run, layers))


def _host(footprint: ModelFootprint, run: RunConfig, stage_plans, processes: int,
          data_parallel: int, encoders: int | None) -> dict[str, int]:
    """Host memory of each step of a run on one machine: every worker reads its stage's weights
    where the family and the run allow (`dpipe.train.trainable.reads_stage_only`), else loads
    the whole denoiser in fp32 before keeping its stage; the cache is built with the encoders
    loaded; training pins the swapped weights of each stage of each replica."""
    step = ("loading the denoiser (each process its stage)" if reads_stage(footprint, run)
            else "loading the denoiser (fp32, every process)")
    out = {step: data_parallel * sum(s.loading for s in stage_plans)}
    if encoders is not None:
        out["caching (encoders loaded)"] = encoders + PROCESS_HOST
    out["training (pinned swap buffers)"] = processes * PROCESS_HOST + data_parallel * sum(
        s.swapped_bytes for s in stage_plans)
    return out


def layout(footprint: ModelFootprint, run: RunConfig, machine: Machine, stages: int,
           data_parallel: int, fp8: bool, files: int | None = None,
           encoders: int | None = None) -> Plan:
    """One layout's plan (fitting or not), with the run's own checkpointing, swap and budget;
    `fp8`: 8-bit base weights by model.base_dtype or model.base_compute (a quantized file's
    own storage, 8-bit or GGUF, is the file's whatever it says)."""
    p = run.pipeline
    budget = int(min(machine.gpu_gib, p.memory_budget_gb or machine.gpu_gib) * GiB)
    bounds = stage_bounds([x.cost for x in footprint.layers], stages, p.partition, p.split)
    storage = base_storage(run, fp8)
    plans = tuple(_stage(footprint, run, machine, bounds[s], bounds[s + 1], s, stages, storage,
                         budget, p.activation_checkpointing, str(p.blocks_to_swap))
                  for s in range(stages))
    slowest = max(s.seconds for s in plans)
    step = (p.micro_batches + stages - 1) * slowest
    samples = p.micro_batches * p.micro_batch_size * data_parallel
    host = _host(footprint, run, plans, stages * data_parallel, data_parallel, encoders)
    disk = None if files is None else files * (footprint.latent_bytes + footprint.text_bytes)
    plan = Plan(machine, stages, data_parallel, storage.name, plans, budget, p.micro_batches,
                samples, step, host, disk)
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
    # A GGUF base is its file's blocks: model.base_dtype and model.base_compute do not apply
    # (dpipe.config.checks refuses them with one).
    bases = ([False] if gguf_base(run) else [True] if keeps_file_base(run) else
             [run.model.base_dtype.quantized] if "model.base_dtype" in fixed or not lora
             else [False, True])
    if lora and run.model.base_compute != BaseCompute.auto and not gguf_base(run):
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


def gguf_base(run: RunConfig) -> bool:
    """Whether the run is a LoRA on a GGUF file, whose Linears keep the file's blocks."""
    from pathlib import Path

    from dpipe.models.common.gguf_files import GGUF_SUFFIX

    path = Path(str(run.model.path)).expanduser()
    return run.model.mode == TrainMode.lora and path.suffix == GGUF_SUFFIX and path.is_file()


def stored_value_bytes(run: RunConfig) -> float | None:
    """Bytes of a frozen Linear value where a LoRA keeps a quantized file's Linears as the file
    stores them: 1 for an 8-bit file (`keeps_file_base`; its scales are `BaseStorage`'s), a
    GGUF file's mean over its Linear weights (`gguf_files.stored_value_bytes`, from its
    header); None where the base is read as training keeps it (an fp8 base is made from the
    values read)."""
    from pathlib import Path

    from dpipe.models.common.gguf_files import stored_value_bytes as gguf_value_bytes

    if keeps_file_base(run):
        return 1.0
    if gguf_base(run):
        return gguf_value_bytes(Path(str(run.model.path)).expanduser())
    return None


def reads_stage(footprint: ModelFootprint, run: RunConfig) -> bool:
    """Whether each worker reads its stage's weights alone (the family and the run allow it:
    `dpipe.train.trainable.reads_stage_only`), not the whole denoiser in fp32."""
    from dpipe.train.trainable import reads_stage_only

    return footprint.stage_loading and reads_stage_only(run)


def process_loading_bytes(footprint: ModelFootprint, run: RunConfig, layers) -> int:
    """Host bytes the worker of a stage of `layers` holds while it reads the denoiser, a
    process's allowance included: its stage's (`stage_loading_bytes`), or the whole denoiser in
    fp32."""
    if reads_stage(footprint, run):
        return stage_loading_bytes(layers, run) + PROCESS_HOST
    return 4 * footprint.params + PROCESS_HOST


def stage_loading_bytes(layers, run: RunConfig) -> int:
    """Host bytes a worker holds while it reads its stage's `layers` (each with the weights
    `footprint.layer_weights` counts, as `LayerFootprint`): each layer as it is read (where a
    LoRA keeps a quantized file's Linears as stored, as the GPU keeps them:
    `BaseStorage.kept_bytes`), and in transit the largest layer or, from a quantized
    safetensors file, a batch of its tensors dequantized in fp32
    (`single_file_weights.BATCH_BYTES`), whichever is more (`loading_bytes`)."""
    from pathlib import Path

    from dpipe.models.common.quantized_files import file_is_quantized
    from dpipe.models.single_file_weights import BATCH_BYTES

    storage = base_storage(run, False)  # an 8-bit base of the run's own is made after reading
    bf16 = run.train.precision == Precision.bf16
    # A bf16 DoRA reads its base in fp32 (its magnitudes are the fp32 base's norms), then casts.
    widen = 2 if bf16 and run.model.mode == TrainMode.lora and run.model.adapter == Adapter.dora \
        else 1
    sizes = [(storage.kept_bytes(x, widen) if storage.from_file else x.frozen_bytes * widen)
             + x.trainable_bytes for x in layers]
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

