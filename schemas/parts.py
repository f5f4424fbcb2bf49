"""Durable, append-only Parquet part files that any reader can open at any moment.

Layout: ``ROOT/<table>/day=YYYY-MM-DD/part-<ms>-<pid>-<n>.parquet`` (hive partitioning, so
``read_parquet('ROOT/spans/**/*.parquet', hive_partitioning=true)`` just works). Each part is
written under a hidden temporary name, fsynced, then renamed: a reader never sees half a file,
and a process killed mid-write leaves at most a ``.*.tmp`` file that no ``*.parquet`` glob matches.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from .tables import SCHEMA_VERSION, TABLES

_counter = itertools.count()


def table_glob(root: str | os.PathLike, table: str) -> str:
    """The glob a reader uses for one table under a traces root."""
    return str(Path(root) / table / "**" / "*.parquet")


def _row_bytes(row: dict[str, Any]) -> int:
    n = 64
    for v in row.values():
        if isinstance(v, (str, bytes)):
            n += len(v)
        elif isinstance(v, (list, tuple)):
            n += 8 * len(v)
        else:
            n += 8
    return n


class PartWriter:
    """Buffers rows of one table and writes them as Parquet parts, flushing by rows, bytes and age.

    Thread-safe. ``flush_seconds`` bounds how long a row may sit in memory (what a SIGKILL can
    lose); a daemon thread enforces it when ``background=True``. ``close()`` flushes everything.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        table: str,
        *,
        flush_rows: int = 5000,
        flush_bytes: int = 16 << 20,
        flush_seconds: float = 1.0,
        background: bool = True,
        fsync: bool = True,
    ) -> None:
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; known: {sorted(TABLES)}")
        self.root = Path(root)
        self.table = table
        self.schema = TABLES[table]
        self.flush_rows = flush_rows
        self.flush_bytes = flush_bytes
        self.flush_seconds = flush_seconds
        self.fsync = fsync
        self.rows_written = 0
        self.parts_written = 0
        self._rows: list[dict[str, Any]] = []
        self._bytes = 0
        self._oldest: float | None = None
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if background and flush_seconds > 0:
            self._thread = threading.Thread(target=self._ticker, name=f"flush-{table}", daemon=True)
            self._thread.start()

    # -- public API -------------------------------------------------------------------------
    def append(self, row: dict[str, Any]) -> None:
        self.extend([row])

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        due = False
        with self._lock:
            for row in rows:
                unknown = set(row) - set(self.schema.names)
                if unknown:
                    raise ValueError(f"{self.table}: unknown columns {sorted(unknown)}")
                self._rows.append(row)
                self._bytes += _row_bytes(row)
                if self._oldest is None:
                    self._oldest = time.monotonic()
            due = len(self._rows) >= self.flush_rows or self._bytes >= self.flush_bytes
        if due:
            self.flush()

    @property
    def buffered(self) -> int:
        with self._lock:
            return len(self._rows)

    def flush(self) -> Path | None:
        """Write everything buffered as one part; returns its path (None if nothing to write)."""
        with self._write_lock:
            with self._lock:
                rows, self._rows = self._rows, []
                self._bytes, self._oldest = 0, None
            if not rows:
                return None
            try:
                return self._write(rows)
            except BaseException:
                # Disk full, permissions...: keep the rows for the next flush instead of losing them.
                with self._lock:
                    self._rows[:0] = rows
                    self._bytes += sum(_row_bytes(r) for r in rows)
                    self._oldest = self._oldest or time.monotonic()
                raise

    def write_table(self, table: pa.Table) -> Path:
        """Write an already-built Arrow table as one part (bypasses the buffer)."""
        with self._write_lock:
            return self._write_arrow(table.cast(self.schema) if table.schema != self.schema else table)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()

    def __enter__(self) -> "PartWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _ticker(self) -> None:
        period = max(0.05, self.flush_seconds / 4)
        while not self._closed.wait(period):
            with self._lock:
                old = self._oldest is not None and time.monotonic() - self._oldest >= self.flush_seconds
            if old:
                try:
                    self.flush()
                except Exception as exc:  # keep flushing later; never kill the host process
                    print(f"[lightning] flush of {self.table} failed: {exc}", flush=True)

    def _write(self, rows: list[dict[str, Any]]) -> Path:
        return self._write_arrow(pa.Table.from_pylist(rows, schema=self.schema))

    def _write_arrow(self, table: pa.Table) -> Path:
        day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
        folder = self.root / self.table / f"day={day}"
        folder.mkdir(parents=True, exist_ok=True)
        name = f"part-{int(time.time() * 1000)}-{os.getpid()}-{next(_counter):06d}.parquet"
        tmp = folder / f".{name}.tmp"
        table = table.replace_schema_metadata(
            {**(self.schema.metadata or {}), b"lightning.schema_version": str(SCHEMA_VERSION).encode()}
        )
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression="zstd")
            fh.flush()
            if self.fsync:
                os.fsync(fh.fileno())
        final = folder / name
        os.replace(tmp, final)
        self.rows_written += table.num_rows
        self.parts_written += 1
        return final


def read_table(root: str | os.PathLike, table: str) -> pa.Table:
    """Read every finished part of a table (an empty table with the schema if there is none)."""
    schema = TABLES[table]
    base = Path(root) / table
    files = sorted(p for p in base.glob("**/*.parquet") if not p.name.startswith(".")) if base.exists() else []
    if not files:
        return schema.empty_table()
    parts = [pq.read_table(f, schema=schema) for f in files]
    return pa.concat_tables(parts)
