"""Builds the DeepSpeed pipeline engine from a model's layers and the run config."""

from __future__ import annotations

import contextlib
import io
import importlib
import json
import logging
import os
from dataclasses import dataclass

import torch
import torch._dynamo
from torch import nn

from dpipe.config.schema import Precision, RunConfig, TrainMode
from dpipe.errors import ConfigError
from dpipe.pipeline.memory import ActivationProbe
from dpipe.pipeline.partition import stage_bounds
from dpipe.pipeline.recompute import offloaded, recomputed

log = logging.getLogger(__name__)


def init_distributed(backend: str) -> None:
    import deepspeed

    # DeepSpeed JIT-compiles a shared-memory op at init (~30 s on a fresh machine) that gloo on
    # CPU does not need. `import deepspeed.comm.torch as m` returns the wrong module, hence this.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    try:
        deepspeed.init_distributed(dist_backend=backend)
    except torch.distributed.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        # Only where rank 0 opens the store on a given port: SLURM's derived port, or torchrun's
        # --master_port (dpipe's own launcher hosts the store on a port it already holds).
        raise ConfigError(
            f"rank 0 could not open the rendezvous port {os.environ.get('MASTER_PORT')}: another "
            "process on this node holds it. On SLURM set DPIPE_MASTER_PORT to a free port; under "
            "torchrun pass a free --master_port"
        ) from None


def start_rank(run: RunConfig) -> torch.device:
    """This process as one rank of a run (RANK/WORLD_SIZE/MASTER_* set): its GPU, with the
    attention kernels chosen before any layer runs or is traced, or its share of the CPU cores;
    then the process group. Returns its device."""
    if torch.cuda.is_available():
        from dpipe.pipeline.attention import use_sdpa_kernels

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        use_sdpa_kernels(run.model, run.pipeline.compiles)
        init_distributed("nccl")
        return torch.device("cuda", torch.cuda.current_device())
    # Workers on one machine share its cores; more threads than cores makes them spin.
    # A SLURM task uses the CPUs it was given (--cpus-per-task), not all of a shared node's.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    given = int(os.environ.get("SLURM_CPUS_PER_TASK") or 0)
    torch.set_num_threads(given or max(1, (os.cpu_count() or 1) // local_world))
    init_distributed("gloo")
    return torch.device("cpu")


def stage_of(rank: int, stages: int, data_parallel: int) -> int:
    """The pipeline stage that `rank` runs, as DeepSpeed's topology places it."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    return PipeDataParallelTopology(num_pp=stages, num_dp=data_parallel).get_coord(rank).pipe


def _pipeline_module_class():
    from deepspeed.pipe import PipelineModule

    class StagedPipelineModule(PipelineModule):
        """A PipelineModule with dpipe's stage bounds, autocast and per-layer activation
        checkpointing (with a one-off measurement of each layer's activations for "auto")."""

        def __init__(self, layers, bounds, autocast_dtype, input_dtype=None, **kwargs):
            self._dpipe_bounds = bounds
            self._autocast_dtype = autocast_dtype
            self._input_dtype = input_dtype  # data (floats needing no grad) is cast to it
            self.checkpointed: set[int] = set()  # local layer indices that recompute
            self.offload = False  # checkpointed layers keep their inputs in host memory
            self.swap = None  # dpipe.pipeline.block_swap.BlockSwap, where layers swap
            self.plans_swap = False  # blocks_to_swap=auto: the memory plan chooses them
            self.probe: ActivationProbe | None = None
            # DeepSpeed prints its seed settings and the topology on rank 0 with print(); dpipe
            # logs the stages itself. Any other line it prints still reaches the console.
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                super().__init__(layers, partition_method="dpipe", **kwargs)
            for line in out.getvalue().splitlines():
                if not line.startswith(("SEED_LAYERS=", "Using topology:")):
                    print(line)

        def _partition_layers(self, method="dpipe"):
            self.parts = list(self._dpipe_bounds)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

        def forward(self, x):
            cast = (torch.autocast(x[0].device.type, dtype=self._autocast_dtype)
                    if self._autocast_dtype is not None else contextlib.nullcontext())
            if self._input_dtype is not None and isinstance(x, tuple):
                x = tuple(t.to(self._input_dtype) if t.is_floating_point() and not t.requires_grad
                          else t for t in x)
            probe, self.probe = self.probe, None  # measures one micro-batch only
            with cast:
                x = forward_layers(self.forward_funcs, x, self.checkpointed, self.offload,
                                   self.swap, probe)
            # DeepSpeed sends stage outputs as they are, and refuses non-contiguous tensors.
            return tuple(t.contiguous() for t in x) if isinstance(x, tuple) else x.contiguous()

        def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
            """Each layer's weights (the trainable ones for LoRA) as safetensors, not pickles: a
            checkpoint's weights load without running code. Spread over the data-parallel
            ranks as DeepSpeed spreads its own layer files."""
            from safetensors.torch import save_file

            from dpipe.pipeline.layer_files import layer_file

            dp_rank, dp_size = self._grid.data_parallel_id, self._grid.data_parallel_size
            num_layers = len(self.forward_funcs)
            if self.checkpoint_parallel_write_pipeline:
                offsets = ds_partition_uniform(num_layers, dp_size)
                start, end = offsets[dp_rank], offsets[dp_rank + 1]
            elif dp_rank != 0:
                return
            else:
                start, end = 0, num_layers
            checkpoint_engine.makedirs(save_dir, exist_ok=True)
            for idx in range(start, end):
                layer = self.forward_funcs[idx]
                if not hasattr(layer, "state_dict"):
                    continue
                state = layer.state_dict()
                if exclude_frozen_params:
                    for name in self._get_frozen_parameter_names(layer):
                        state.pop(name, None)
                save_file(_unshared_cpu(state), layer_file(save_dir, idx + self._local_start),
                          metadata={"format": "pt", **export_names_metadata(layer, state)})

        def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
            """Loads each layer's file (safetensors, or an older checkpoint's pickle) after a
            strict key and shape check: every trainable tensor (every tensor when `strict`)
            must be there with its shape, or a block would silently keep its fresh weights."""
            from dpipe.pipeline.layer_files import check_layer_state, read_layer_state

            for idx, layer in enumerate(self.forward_funcs):
                if not hasattr(layer, "load_state_dict"):
                    continue
                index = idx + self._local_start
                state, path = read_layer_state(load_dir, index)
                check_layer_state(layer, state, path, strict)
                layer.load_state_dict(state, strict=strict)
            self._synchronize_tied_weights()

    return StagedPipelineModule


def forward_layers(layers, x, checkpointed: set[int], offload: bool = False, swap=None,
                   probe: ActivationProbe | None = None):
    """A stage's forward over its layers: each checkpointed one recomputes in backward (its
    input offloaded to the host with `offload`), a swapped one has its weights copied in around
    its call (dpipe.pipeline.block_swap), and `probe` measures each layer first."""
    for i, layer in enumerate(layers):
        if swap is not None:
            swap.before(i)
        if probe is not None:
            probe.measure(i, layer, x)
        if i in checkpointed and torch.is_grad_enabled():
            x = (offloaded if offload else recomputed)(layer, x)
        else:
            x = layer(x)
        if swap is not None:
            swap.after(i, x)
    if swap is not None:
        swap.end_pass()
    return x


def ds_partition_uniform(num_items: int, num_parts: int) -> list[int]:
    from deepspeed.runtime.utils import partition_uniform

    return partition_uniform(num_items, num_parts)


def export_names_metadata(layer, state: dict) -> dict[str, str]:
    """The diffusers name of each parameter in a layer file (`EXPORT_NAMES`, JSON), so that
    `dpipe-export` writes a checkpoint's weights in the family's formats without building the
    model; buffers have none (exports hold parameters only)."""
    from dpipe.pipeline.layer_files import EXPORT_NAMES

    if not hasattr(layer, "source_named_parameters"):
        return {}
    names = {local: source for (local, _), (source, _) in
             zip(layer.named_parameters(), layer.source_named_parameters()) if local in state}
    return {EXPORT_NAMES: json.dumps(names)}


def _unshared_cpu(state: dict) -> dict:
    """The tensors on the CPU, contiguous, none sharing memory (safetensors refuses shared)."""
    out, seen = {}, set()
    for name, tensor in state.items():
        t = tensor.detach().to("cpu").contiguous()
        storage = t.untyped_storage().data_ptr()
        out[name] = t.clone() if storage in seen else t
        seen.add(storage)
    return out


@dataclass
class BuiltEngine:
    engine: object  # deepspeed.runtime.pipe.engine.PipelineEngine
    bounds: list[int]
    stage: int
    trainable_parameters: int


def deepspeed_bf16(run: RunConfig) -> bool:
    """bf16 full fine-tunes with fp32 master weights run in DeepSpeed's bf16 mode."""
    return (run.train.precision == Precision.bf16 and run.model.mode == TrainMode.full
            and run.optim.master_weights)


def deepspeed_wraps_optimizer(run: RunConfig) -> bool:
    """Whether DeepSpeed puts its own optimizer (bf16 or ZeRO) around ours; it then clips."""
    return deepspeed_bf16(run) or run.pipeline.zero_stage > 0


def deepspeed_config(run: RunConfig, data_parallel: int) -> dict:
    p = run.pipeline
    full_bf16 = deepspeed_bf16(run)
    return {
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.micro_batches,
        "train_batch_size": p.micro_batch_size * p.micro_batches * data_parallel,
        "gradient_clipping": run.optim.grad_clip if deepspeed_wraps_optimizer(run) else 0.0,
        "zero_optimization": {"stage": p.zero_stage},
        "bf16": {"enabled": full_bf16},
        "steps_per_print": 1 << 30,  # dpipe reports progress itself
        "wall_clock_breakdown": False,
    }


def build_engine(
    layers: list[nn.Module], costs: list[float], loss_fn, run: RunConfig, data_parallel: int,
    optimizer_for,
) -> BuiltEngine:
    """This rank's stage of `layers` as a DeepSpeed pipeline engine. `optimizer_for(named)`
    gives the (optimizer, lr scheduler) for the stage's trainable parameters, `named` as
    (diffusers name, parameter) pairs: the trainer builds them (dpipe.train.optim)."""
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from dpipe.pipeline.stage_engine import adopt

    p = run.pipeline
    bounds = stage_bounds(costs, p.stages, p.partition, p.split)
    # Full bf16 fine-tunes with master weights use DeepSpeed's bf16 mode (fp32 copies in the
    # optimizer); every other bf16 run (LoRA's fp32 adapters over bf16 frozen weights, bf16
    # weights trained directly) runs the layers under autocast.
    autocast = run.train.precision == Precision.bf16 and not deepspeed_bf16(run)
    module = _pipeline_module_class()(
        layers,
        bounds,
        torch.bfloat16 if autocast else None,
        # DeepSpeed's bf16 mode runs bf16 layers without autocast: the data (fp32 latents and
        # noise, fp32 timesteps) must arrive in bf16.
        torch.bfloat16 if deepspeed_bf16(run) else None,
        topology=PipeDataParallelTopology(num_pp=p.stages, num_dp=data_parallel),
        loss_fn=loss_fn,
        dynamic_shape=True,  # buckets change tensor shapes between micro-batches
    )
    _release_other_stages(layers, module)
    module.swap, module.plans_swap = _block_swap(layers, bounds, module, run)
    if p.compiles:
        # One layer class's compiled forward serves every layer of that class and every shape
        # it meets: buckets, frame counts and prompt lengths (text padding is cut) each add
        # graphs, and HunyuanVideo's double and single blocks share one wrapper. Past dynamo's
        # default of 8, a layer silently runs eager: tiny HunyuanVideo reached it on the CPU
        # with images, 5-frame clips and six prompt lengths (docs/bench-results/h200-1gpu-flex).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for layer in module.forward_funcs:
            layer.compile()
        log.info("stage %d: its %d layers compile in the first step (pipeline.compile)",
                 module.stage_id, len(module.forward_funcs))
    trainable = [q for q in module.parameters() if q.requires_grad]
    if not trainable:
        stage = module.stage_id
        raise ConfigError(
            f"pipeline stage {stage} (layers {bounds[stage]}-{bounds[stage + 1] - 1}) has nothing "
            "to train: with LoRA its layers hold no adapters. Use fewer pipeline.stages, or "
            "pipeline.partition=explicit with a pipeline.split that gives every stage a block"
        )
    named = [(name, q) for layer in module.forward_funcs
             for name, q in layer.source_named_parameters() if q.requires_grad]
    assert len(named) == len(trainable), "a trainable parameter outside the pipeline layers"
    optimizer, scheduler = optimizer_for(named)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(run, data_parallel),
    )
    engine = adopt(engine, p.stages)
    if module.swap is not None:
        module.swap.attach(engine.device)
    module.checkpointed = _fixed_checkpointing(p.activation_checkpointing,
                                               len(module.forward_funcs))
    module.offload = p.activation_checkpointing == "offload"
    return BuiltEngine(
        engine=engine,
        bounds=bounds,
        stage=engine.stage_id,
        trainable_parameters=sum(q.numel() for q in trainable),
    )


def _release_other_stages(layers: list[nn.Module], module) -> None:
    """Frees the weights of layers that other stages own: each rank keeps only its share."""
    local = {id(layer) for layer in module.forward_funcs}
    for layer in layers:
        if id(layer) not in local:
            layer.to("meta")


def _fixed_checkpointing(setting: str, num_local: int) -> set[int]:
    """The checkpointed local layers for a fixed setting; "auto" starts from none (and is planned
    from measurements by `dpipe.pipeline.memory`)."""
    if setting in ("all", "offload"):
        return set(range(num_local))
    if setting.isdigit():
        return set(range(min(int(setting), num_local)))
    return set()


def _block_swap(layers: list[nn.Module], bounds: list[int], module, run: RunConfig):
    """This stage's BlockSwap (`pipeline.blocks_to_swap`) and whether the memory plan chooses its
    layers, after the checks that need the model: every stage has the layers to swap, and the
    budget is above what the weights alone take with every layer swapped. Every rank checks
    every stage, so all of them raise together."""
    from dpipe.pipeline.block_swap import BlockSwap, first_swappable, swappable

    p = run.pipeline
    auto = str(p.blocks_to_swap) == "auto"
    count = 0 if auto else int(p.blocks_to_swap)
    stages = [layers[bounds[s]:bounds[s + 1]] for s in range(p.stages)]
    own = [swappable(stage) for stage in stages]
    if count > min(len(o) for o in own):
        stage = min(range(p.stages), key=lambda s: len(own[s]))
        raise ConfigError(
            f"pipeline.blocks_to_swap={count}, but pipeline stage {stage} (layers "
            f"{bounds[stage]}-{bounds[stage + 1] - 1}) has {len(own[stage])} layers with frozen "
            f"weights to swap; use at most {len(own[stage])} (or auto, with "
            "pipeline.memory_budget_gb)")
    if p.memory_budget_gb is not None and (auto or count):
        _check_budget_reachable(stages, own, p.memory_budget_gb)
    if not count and not (auto and torch.cuda.is_available()):
        return None, False  # auto on the CPU swaps nothing, as auto checkpointing recomputes none
    local = list(module.forward_funcs)
    if not torch.cuda.is_available() and module.stage_id == 0:
        log.info("pipeline.blocks_to_swap=%s on the CPU: the weights are copied between two "
                 "host tensors, which saves no memory (it runs the GPU's bookkeeping)", count)
    chosen = swappable(local) if auto else first_swappable(local, count)
    return BlockSwap(local, chosen), auto


def weights_on_device(stages: list[list[nn.Module]], own: list[dict]) -> list[int]:
    """Bytes of weights each stage keeps on the device with the layers of `own` swapped
    (`swappable`'s dicts; empty: none): trainable weights and their gradients, frozen weights
    not swapped, and the two largest swapped layers' frozen weights. A lower bound of the peak
    (optimizer state and activations come on top); it needs no GPU (meta tensors do)."""
    from dpipe.pipeline.block_swap import frozen_bytes

    def nbytes(t):
        return t.numel() * t.element_size()

    need = []
    for layers, swapped in zip(stages, own):
        trainable = sum(2 * nbytes(q) for layer in layers for q in layer.parameters()
                        if q.requires_grad)
        frozen = sum(frozen_bytes(layer) for layer in layers)
        moved = [sum(nbytes(t) for t in ts) for ts in swapped.values()]
        need.append(trainable + frozen - sum(moved) + sum(sorted(moved, reverse=True)[:2]))
    return need


def _check_budget_reachable(stages: list[list[nn.Module]], own: list[dict], budget_gb: float):
    """The weights a stage keeps on the device with every layer swapped must fit the budget
    (`weights_on_device`)."""
    from dpipe.pipeline.memory import GiB

    need = weights_on_device(stages, own)
    worst = max(range(len(stages)), key=need.__getitem__)
    if need[worst] > budget_gb * GiB:
        raise ConfigError(
            f"pipeline.memory_budget_gb={budget_gb:g} is below what pipeline stage {worst} needs "
            f"even with every layer swapped: {need[worst] / GiB:.2f} GiB for its weights alone "
            "(trainable weights and gradients, frozen weights that cannot swap, two swapped "
            "layers in flight), before optimizer state and activations; raise the budget to "
            "more than that, use more pipeline.stages, or model.base_dtype=fp8")


@contextlib.contextmanager
def quiet_deepspeed():
    """DeepSpeed logs every engine detail at INFO; users see dpipe's summary instead."""
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    ds_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        ds_logger.setLevel(level)
