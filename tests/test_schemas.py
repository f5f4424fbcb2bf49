"""The trace tables: documented fields, versioned files, atomic parts readable by DuckDB-style globs."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lightning_harness.schemas import SCHEMA_VERSION, TABLES, PartWriter, describe, read_table


def test_every_field_documented():
    for name, schema in TABLES.items():
        assert schema.metadata[b"lightning.table"].decode() == name
        for field_name, _type, doc in describe(name):
            assert doc, f"{name}.{field_name} has no doc"


def test_parts_carry_version_and_roundtrip(tmp_path: Path):
    with PartWriter(tmp_path, "rewards", background=False) as w:
        w.append({"reward_id": "x", "rollout_id": "r1", "attempt": 0, "reward": 1.5,
                  "created_at": dt.datetime.now(dt.UTC), "source": "api"})
    files = list((tmp_path / "rewards").glob("day=*/part-*.parquet"))
    assert len(files) == 1
    assert pq.read_metadata(files[0]).metadata[b"lightning.schema_version"] == str(SCHEMA_VERSION).encode()
    rows = read_table(tmp_path, "rewards").to_pylist()
    assert rows[0]["rollout_id"] == "r1" and rows[0]["reward"] == 1.5
    # all-None columns keep their declared types
    assert read_table(tmp_path, "rewards").schema.field("info_json").type == "string"


def test_unknown_column_is_a_clear_error(tmp_path: Path):
    w = PartWriter(tmp_path, "rewards", background=False)
    with pytest.raises(ValueError, match="unknown columns"):
        w.append({"reward_id": "x", "rollout_id": "r", "reward": 1.0, "bogus": 1})


def test_flush_by_rows_and_time(tmp_path: Path):
    w = PartWriter(tmp_path, "rewards", flush_rows=3, flush_seconds=0.3)
    for i in range(3):
        w.append({"reward_id": str(i), "rollout_id": "r", "reward": float(i)})
    assert w.parts_written == 1  # by rows, immediately
    w.append({"reward_id": "late", "rollout_id": "r", "reward": 9.0})
    deadline = time.monotonic() + 10
    while w.parts_written < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.parts_written == 2  # by age, from the background thread
    w.close()
    assert read_table(tmp_path, "rewards").num_rows == 4


def test_sigkill_mid_writing_leaves_only_readable_parts(tmp_path: Path):
    code = f"""
import itertools
from lightning_harness.schemas import PartWriter
w = PartWriter({str(tmp_path)!r}, "spans", flush_rows=50, flush_seconds=0.05)
for i in itertools.count():
    w.append({{"span_id": str(i), "rollout_id": "r", "prompt_token_ids": list(range(500)),
              "request_json": "x" * 2000}})
"""
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    parts = list((tmp_path / "spans").glob("**/*.parquet"))
    assert parts, "the writer produced no part before being killed"
    table = read_table(tmp_path, "spans")  # every visible part must open
    assert table.num_rows >= 50


def test_failed_write_keeps_rows_for_the_next_flush(tmp_path: Path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the table folder should be")
    w = PartWriter(blocked, "rewards", background=False)
    w.append({"reward_id": "x", "rollout_id": "r", "reward": 1.0})
    with pytest.raises(OSError):
        w.flush()
    assert w.buffered == 1
    w.root = tmp_path / "ok"
    w.flush()
    assert read_table(tmp_path / "ok", "rewards").num_rows == 1
