"""What the hostile-input safety nets cost: PartWriter on clean vs poisoned batches, part checks.

    .venv/bin/python scripts/bench_writer.py [--rows 20000] [--parts 2000]

Prints (1) rows/s of PartWriter.flush for clean span rows and for the same batch with one row
holding a lone surrogate (the per-row salvage path), (2) the time to list N parts with their
footers checked, cold and cached (what every `lightning-sql` / views connect pays).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from lightning_harness.schemas import PartWriter, checked, finished_parts


def rows(n: int, poison: bool) -> list[dict]:
    out = [{"span_id": f"s{i}", "rollout_id": f"r{i % 50}", "attempt": 0, "seq": i,
            "request_json": '{"messages": [{"role": "user", "content": "%s"}]}' % ("x" * 400),
            "response_json": "y" * 300, "prompt_token_ids": list(range(64)), "response_token_ids": list(range(16)),
            "response_logprobs": [-0.1] * 16} for i in range(n)]
    if poison:
        out[n // 2]["request_json"] = "bad \ud800"
    return out


def bench_writer(n: int, poison: bool) -> float:
    with tempfile.TemporaryDirectory() as d:
        w = PartWriter(d, "spans", background=False, flush_rows=5000, fsync=False)
        batch = rows(n, poison)
        t = time.perf_counter()
        w.extend(batch)
        w.flush()
        dt = time.perf_counter() - t
        assert w.rows_written == n and w.rows_salvaged == int(poison)
        return n / dt


def bench_parts(n: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        w = PartWriter(d, "spans", background=False, fsync=False)
        for i in range(n):
            w.append({"span_id": str(i)})
            w.flush()
        checked._cache.clear()
        t = time.perf_counter()
        good, bad = finished_parts(Path(d), "spans")
        cold = time.perf_counter() - t
        t = time.perf_counter()
        finished_parts(Path(d), "spans")
        warm = time.perf_counter() - t
        assert len(good) == n and not bad
        return cold, warm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--parts", type=int, default=2000)
    a = ap.parse_args()
    clean = max(bench_writer(a.rows, False) for _ in range(3))  # best of 3: the machine may be shared
    poisoned = max(bench_writer(a.rows, True) for _ in range(3))
    print(f"PartWriter flush, {a.rows} span rows: clean {clean:,.0f} rows/s; "
          f"one poisoned row per flush {poisoned:,.0f} rows/s (ratio {clean / poisoned:.2f})")
    cold, warm = bench_parts(a.parts)
    print(f"list + check {a.parts} parts: cold {cold * 1000:.0f} ms ({cold / a.parts * 1e6:.0f} us/part), "
          f"cached {warm * 1000:.0f} ms ({warm / a.parts * 1e6:.0f} us/part)")


if __name__ == "__main__":
    main()
