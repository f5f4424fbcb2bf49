"""The trace tables: the one contract between proxy, launcher and trainer.

Importable with pyarrow alone, so the proxy's environment (mitmproxy) and the training
environment (torch, vLLM, DuckDB) share it. Every table is an explicit Arrow schema with a
doc string per field; every Parquet file carries ``lightning.schema_version`` and
``lightning.table`` in its metadata.
"""

from .checked import finished_parts
from .compact import CompactReport, compact_store, compact_table
from .parts import BufferFull, PartWriter, listed_parts, read_table
from .tables import (
    METRICS,
    REWARDS,
    ROLLOUTS,
    SAMPLES,
    SCHEMA_VERSION,
    SPANS,
    TABLES,
    describe,
)

__all__ = [
    "METRICS",
    "REWARDS",
    "ROLLOUTS",
    "SAMPLES",
    "SCHEMA_VERSION",
    "SPANS",
    "TABLES",
    "BufferFull",
    "CompactReport",
    "compact_store",
    "compact_table",
    "PartWriter",
    "describe",
    "finished_parts",
    "listed_parts",
    "read_table",
]
