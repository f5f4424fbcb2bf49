#!/usr/bin/env python
"""How `lightning-train report` scales: page time and size for N rollouts, against reading the same
traces with one plain DuckDB query (the baseline, measured in the same run).

The traces are tests/data/report_run's (a real run) repeated under new rollout ids until N rollouts.

    .venv/bin/python scripts/bench_report.py [--rollouts 1000]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from lightning_harness.schemas import PartWriter, read_table
from lightning_harness.trainer.report import write_report
from lightning_harness.trainer.views import connect

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "data" / "report_run"


def copies(table: pa.Table, n: int) -> pa.Table:
    """``n`` copies of ``table``, rollout ids (and span/sample ids) suffixed with the copy number."""
    parts = []
    for i in range(n):
        t = table
        for col in ("rollout_id", "span_id", "sample_id"):
            if col in t.column_names:
                t = t.set_column(t.schema.get_field_index(col), col,
                                 pc.binary_join_element_wise(t[col], pa.scalar(f"~{i}"), ""))
        if "span_ids" in t.column_names:
            ids = [[f"{s}~{i}" for s in row] for row in t["span_ids"].to_pylist()]
            t = t.set_column(t.schema.get_field_index("span_ids"), "span_ids",
                             pa.array(ids, t.schema.field("span_ids").type))
        parts.append(t)
    return pa.concat_tables(parts)


def build(n_rollouts: int, into: Path) -> int:
    base = read_table(RUN / "traces", "rollouts").num_rows
    times = max(1, round(n_rollouts / base))
    for table in ("spans", "rollouts", "rewards", "samples", "metrics"):
        t = read_table(RUN / "traces", table)
        PartWriter(into / "traces", table, background=False).write_table(t if table == "metrics" else copies(t, times))
    for name in ("state.json", "config.yaml", "summary.json"):
        shutil.copy(RUN / name, into / name)
    return base * times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-report-"))
    try:
        n = build(args.rollouts, work)
        t0 = time.perf_counter()
        con = connect(work / "traces")
        con.execute("SELECT * FROM spans").fetchall()
        con.execute("SELECT * FROM samples").fetchall()
        con.close()
        baseline = time.perf_counter() - t0
        t0 = time.perf_counter()
        page = write_report(work, work / "page.html", tokenizer=str(ROOT / "examples" / "calc" / "model"),
                            max_rollouts=n)
        took = time.perf_counter() - t0
        size = page.stat().st_size
        print(f"{n} rollouts: page {took:.2f} s ({took / n * 1000:.2f} ms/rollout), {size / 2**20:.2f} MiB "
              f"({size / n / 1024:.1f} KiB/rollout); plain DuckDB read of spans+samples {baseline:.2f} s "
              f"-> {took / baseline:.1f}x the read")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
