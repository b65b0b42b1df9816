"""The stored size of each family's denoiser at real size, per base storage: a markdown table.

    .venv/bin/python scripts/base_memory_table.py

Each family's benchmark configs (`dpipe-bench --size`: the releases' sizes) built on the meta
device, no weights read. The blocks' Linears (those `model.base_dtype` quantizes: the repeated
blocks' nn.Linear weights) are counted in each storage, the rest of the model (embedders, norms,
biases, the output head) in bf16 for every column, as dpipe holds them:
- bf16: 2 bytes a weight.
- fp8 / int8 / int8_bnb: 1 byte a weight and a 4-byte scale per output row.
- nf4: half a byte a weight, a 4-byte absmax per 64 weights and the 16-value code book.
- GGUF Q8_0: 34 bytes per 32 weights; Q4_K: 144 bytes per 256. A Linear whose rows do not
  split into the type's blocks is counted in F16 (2 bytes), as city96's tool keeps such
  tensors unquantized or in a wider type: an upper bound.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

GiB = 1 << 30


def block_linears(model: nn.Module) -> list[nn.Linear]:
    """The Linears `dpipe.train.fp8.quantize_frozen_linears` quantizes: those of the blocks."""
    seen, out = set(), []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for m in module.modules():
                if type(m) is nn.Linear and id(m) not in seen:
                    seen.add(id(m))
                    out.append(m)
    return out


def _blocked(rows: int, cols: int, block: int, size: int) -> int:
    return rows * cols // block * size if cols % block == 0 else 2 * rows * cols


STORAGES = {
    "bf16": lambda r, c: 2 * r * c,
    "fp8/int8": lambda r, c: r * c + 4 * r,
    "nf4": lambda r, c: r * c // 2 + 4 * -(-r * c // 64) + 64,
    "GGUF Q8_0": lambda r, c: _blocked(r, c, 32, 34),
    "GGUF Q4_K": lambda r, c: _blocked(r, c, 256, 144),
}


def sizes(model: nn.Module) -> dict[str, int]:
    linears = block_linears(model)
    inside = {id(m.weight) for m in linears}
    rest = sum(2 * p.numel() for p in model.parameters() if id(p) not in inside)
    return {name: rest + sum(bytes_of(*m.weight.shape) for m in linears)
            for name, bytes_of in STORAGES.items()}


def main() -> None:
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import FAMILIES, build_spec

    print("| family | size | parameters | " + " | ".join(STORAGES) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in STORAGES) + " |")
    for family in sorted(FAMILIES):
        run = compose_run([f"model={family}", "model.path=/unused", "dataset=synthetic"])
        spec = build_spec(run.model)
        for size in spec.bench_sizes():
            if size == "tiny":  # the test models
                continue
            try:
                model = spec.for_benchmark(size).random_denoiser(size, torch.bfloat16,
                                                                torch.device("meta"))
            except NotImplementedError:
                continue
            params = sum(p.numel() for p in model.parameters())
            cells = " | ".join(f"{b / GiB:.2f}" for b in sizes(model).values())
            print(f"| {family} | {size} | {params / 1e9:.2f}B | {cells} |", flush=True)


if __name__ == "__main__":
    main()
