"""Read a W&B offline run file (``run-ID.wandb``) back: its history rows, as the trackers test needs.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version), then
LevelDB-log-style records (crc32 4, length 2, type 1: full/first/middle/last) in 32 KiB blocks, each
record a ``wandb_internal_pb2.Record`` protobuf. wandb ships the protobuf types but no reader.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B run file"
    pos, buf = 7, b""
    while pos + HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER.size:  # block tail padding
            pos += left
            continue
        _crc, length, kind = HEADER.unpack_from(data, pos)
        if kind == 0:
            pos += left
            continue
        payload = data[pos + HEADER.size:pos + HEADER.size + length]
        pos += HEADER.size + length
        buf = payload if kind in (FULL, FIRST) else buf + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


def history(path: str | Path) -> list[dict]:
    """The logged rows, W&B's own keys (``_step``, ``_runtime``...) included."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows
