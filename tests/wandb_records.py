"""Reading a W&B run file (`run-<id>.wandb`) back, as the tests' own check of what `molt` logged.

The file is wandb's transaction log: a 7-byte header (`:W&B`, a 2-byte key, a version byte), then
32 KiB blocks of chunks, each a 7-byte header (CRC32, little-endian length, kind: 1 whole, 2 first,
3 middle, 4 last) and its bytes; a block's tail shorter than a chunk header is padding. The chunks of
one record joined are a protobuf `wandb.proto.wandb_internal_pb2.Record` (wandb's own message)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path):
    """Every `Record` in the file, in order."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:  # the zero-filled rest of the last block
            break
        parts.append(data[pos + HEADER : pos + HEADER + length])
        pos += HEADER + length
        if kind in (1, 4):
            yield Record.FromString(b"".join(parts))
            parts = []


def run_file(run_dir: Path, timeout: float = 60.0) -> Path:
    """The one offline W&B run file under `<run_dir>/wandb`, once it is whole: wandb's service process
    writes it behind the caller, so `wandb.finish()` can return before the last records (its `exit`
    record) are in it; a busy machine shows that."""
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in records(path)):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout:.0f} s"
        time.sleep(0.2)
    return path


def history(run_dir: Path) -> dict[int, dict[str, float]]:
    """The one offline W&B run under `<run_dir>/wandb`: each logged step's values by name."""
    path = run_file(run_dir)
    steps = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                      for item in record.history.item}  # fmt: skip
            steps[values.pop("_step")] = values
    return steps


def config(run_dir: Path) -> dict:
    """The offline W&B run's config, by top-level key."""
    path = run_file(run_dir)
    found = {}
    for record in records(path):  # the run record holds the config `wandb.init` was given
        kind = record.WhichOneof("record_type")
        updates = {"run": record.run.config.update, "config": record.config.update}.get(kind, [])
        for item in updates:
            found[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return found
