"""Reads an offline wandb run's records (<run>/wandb/offline-run-*/run-<id>.wandb): a 7-byte
header, then leveldb's log format (32 KiB blocks of chunks: crc32, length, type) around
protobuf `Record`s (wandb.proto.wandb_internal_pb2)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7  # ":W&B", a 2-byte magic, a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_files(run_dir: Path, run_id: str) -> list[Path]:
    """The offline run's record files, oldest first (a resume adds one)."""
    return sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb record file"
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def history(path: Path, key: str) -> dict[int, float]:
    """{step: value} of `key` in the run's history (TensorBoard's global_step as the step)."""
    out = {}
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                 for item in record.history.item}
        if key in items:
            out[int(items.get("global_step", record.history.step.num))] = items[key]
    return out


def config(path: Path) -> dict:
    """The run config the wandb run holds, {top-level key: value}."""
    out = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = (record.run.config.update if kind == "run" else
                   record.config.update if kind == "config" else [])
        for item in updates:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
