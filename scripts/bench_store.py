"""Benchmark: a long run's trace store before and after compaction (``schemas.compact``).

Synthesises a store shaped like a long training run: ``--spans`` spans (rollouts of ``--calls``
calls, groups of ``--group-size`` rollouts, ``--groups`` groups per step, the model version going up
one per step), written the way the proxy and the launcher write them: many small parts through the
real ``schemas.PartWriter`` (``write_table``, the writer's own atomic part path; one part per
``--spans-per-part`` spans, about one flush second of a busy proxy, and one rollouts part per step).
fsync is off while synthesising (it only changes the synthesis time).

Then, before and after ``compact_store`` (same run, same process), it prints: files per table,
one step's samples (``build_samples`` for ``--groups`` groups of one step, reading only their
rollouts), ``SELECT count(*) FROM spans`` and a group-by over the spans, each with a fresh
connection as ``lightning-sql`` makes (wall seconds, and CPU seconds of the process: the machine may
be shared), and the after/before ratios.

    .venv/bin/python scripts/bench_store.py            # 1,000,000 spans (synthesis: minutes on 2 cores)
    .venv/bin/python scripts/bench_store.py --quick    # 100,000 spans

Targets (issue 12): after compaction, samples for 8 groups <= 0.5 s, count and group-by <= 1 s.
"""

from __future__ import annotations

import datetime as dt
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.table import Table

from lightning_harness.schemas import ROLLOUTS, SPANS, PartWriter, compact_store, finished_parts


def _list(values: np.ndarray, lens: np.ndarray, typ: pa.DataType) -> pa.ListArray:
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(off), pa.array(values, typ))


def _table(cols: dict, schema: pa.Schema, n: int) -> pa.Table:
    return pa.Table.from_arrays([cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in schema],
                                schema=schema)


class StoreShape:
    """Ids of the synthetic run: step k holds groups k*G .. k*G+G-1, each of ``group_size`` rollouts."""

    def __init__(self, n_spans: int, calls: int, group_size: int, groups: int) -> None:
        self.calls, self.group_size, self.groups = calls, group_size, groups
        self.per_step = calls * group_size * groups  # spans per step
        self.steps = max(1, n_spans // self.per_step)

    def rollout_ids(self, step: int) -> list[str]:
        return [f"bench-s{step}-t{step * self.groups + g}-{i}"
                for g in range(self.groups) for i in range(self.group_size)]

    def group_ids(self, step: int) -> list[str]:
        return [f"t{step * self.groups + g}@{step}" for g in range(self.groups)]


def _spans_of_step(shape: StoreShape, step: int, rng: np.random.Generator, t0: dt.datetime) -> pa.Table:
    rids = shape.rollout_ids(step)
    n = len(rids) * shape.calls
    seq = np.tile(np.arange(shape.calls, dtype=np.int32), len(rids))
    rl = rng.integers(4, 17, n)
    pl = 32 + seq * 20 + rng.integers(0, 8, n)
    prompt = rng.integers(0, 2000, int(pl.sum()), dtype=np.int32)
    resp = rng.integers(0, 2000, int(rl.sum()), dtype=np.int32)
    ts = pa.array([t0 + dt.timedelta(seconds=step, milliseconds=int(i)) for i in range(n)],
                  pa.timestamp("us", tz="UTC"))
    cols = {
        "span_id": pa.array([f"sp-{step}-{i}" for i in range(n)]),
        "rollout_id": pa.array(np.repeat(np.array(rids, dtype=object), shape.calls).tolist()),
        "attempt": pa.array(np.zeros(n, np.int32)), "seq": pa.array(seq),
        "started_at": ts, "ended_at": ts, "latency_ms": pa.array(rng.gamma(2.0, 200.0, n)),
        "endpoint": pa.array(["chat.completions"] * n), "model_version": pa.array(np.full(n, step, np.int64)),
        "status_code": pa.array(np.full(n, 200, np.int32)), "finish_reason": pa.array(["stop"] * n),
        "prompt_token_ids": _list(prompt, pl, pa.int32()), "response_token_ids": _list(resp, rl, pa.int32()),
        "response_logprobs": _list((-rng.exponential(0.5, len(resp))).astype(np.float32), rl, pa.float32()),
        "prompt_tokens": pa.array(pl.astype(np.int32)), "completion_tokens": pa.array(rl.astype(np.int32)),
    }
    return _table(cols, SPANS, n)


def _rollouts_of_step(shape: StoreShape, step: int, rng: np.random.Generator) -> pa.Table:
    rids = shape.rollout_ids(step)
    n = len(rids)
    groups = np.repeat(np.array(shape.group_ids(step), dtype=object), shape.group_size).tolist()
    cols = {
        "rollout_id": pa.array(rids), "attempt": pa.array(np.zeros(n, np.int32)), "run_id": pa.array(["bench"] * n),
        "task_id": pa.array([g.split("@")[0] for g in groups]), "group_id": pa.array(groups),
        "sample_index": pa.array(np.tile(np.arange(shape.group_size, dtype=np.int32), shape.groups)),
        "step": pa.array(np.full(n, step, np.int64)), "split": pa.array(["train"] * n),
        "state": pa.array(["succeeded"] * n), "reward": pa.array((rng.random(n) < 0.5).astype(np.float64)),
        "model_version": pa.array(np.full(n, step, np.int64)),
    }
    return _table(cols, ROLLOUTS, n)


def synthesise(root: Path, shape: StoreShape, spans_per_part: int, seed: int = 0) -> int:
    """Write the store; returns the number of spans."""
    rng = np.random.default_rng(seed)
    t0 = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
    spans = PartWriter(root, "spans", background=False, fsync=False)
    rollouts = PartWriter(root, "rollouts", background=False, fsync=False)
    pending: list[pa.Table] = []
    total = 0
    for step in range(shape.steps):
        pending.append(_spans_of_step(shape, step, rng, t0))
        rollouts.write_table(_rollouts_of_step(shape, step, rng))
        buf = pa.concat_tables(pending)
        while buf.num_rows >= spans_per_part:
            spans.write_table(buf.slice(0, spans_per_part))
            buf = buf.slice(spans_per_part)
        pending = [buf] if buf.num_rows else []
        total += shape.per_step
    if pending:
        spans.write_table(pa.concat_tables(pending))
    return total


def _timed(fn, repeat: int) -> tuple[float, float]:
    """Fastest of ``repeat`` runs: (wall seconds, CPU seconds of this process, all threads)."""
    best = (float("inf"), float("inf"))
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        best = min(best, (time.perf_counter() - t, time.process_time() - c))
    return best


def measure(root: Path, shape: StoreShape, repeat: int) -> dict[str, float]:
    from lightning_harness.trainer.samples import build_samples
    from lightning_harness.trainer.views import connect

    step = shape.steps // 2
    gids = shape.group_ids(step)
    where = "split = 'train' AND group_id IN (" + ", ".join(f"'{g}'" for g in gids) + ")"
    out: dict[str, float] = {}
    built = {}

    def samples():
        built["t"], _ = build_samples(root, where=where, rollouts=shape.rollout_ids(step))

    out["samples_s"], out["samples_cpu_s"] = _timed(samples, repeat)
    out["samples_rows"] = built["t"].num_rows
    out["count_s"], out["count_cpu_s"] = _timed(lambda: connect(root).sql("SELECT count(*) FROM spans").fetchall(),
                                                repeat)
    out["groupby_s"], out["groupby_cpu_s"] = _timed(lambda: connect(root).sql(
        "SELECT model_version, count(*), avg(latency_ms) FROM spans GROUP BY model_version").fetchall(), repeat)
    out["count"] = connect(root).sql("SELECT count(*) FROM spans").fetchall()[0][0]
    for t in ("spans", "rollouts"):
        out[f"files_{t}"] = len(finished_parts(root, t)[0])
    out["_samples"] = built["t"]
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--spans", "n_spans", default=1_000_000, show_default=True, help="Synthetic spans in the store.")
@click.option("--quick", is_flag=True, help="100,000 spans (a quick look).")
@click.option("--calls", default=4, show_default=True, help="Calls per rollout.")
@click.option("--group-size", default=4, show_default=True, help="Rollouts per group.")
@click.option("--groups", default=8, show_default=True, help="Groups per step (one update's samples).")
@click.option("--spans-per-part", default=128, show_default=True, help="Spans per part as written (one flush).")
@click.option("--repeat", default=3, show_default=True, help="Timed runs per figure; the fastest is shown.")
@click.option("--dir", "folder", type=click.Path(file_okay=False), default=None,
              help="Build the store here (default: a temp dir).")
def main(n_spans, quick, calls, group_size, groups, spans_per_part, repeat, folder) -> None:
    """Synthesise a long run's store, then time samples and queries before and after compaction."""
    console = Console()
    shape = StoreShape(100_000 if quick else n_spans, calls, group_size, groups)
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        root = Path(folder or tmp)
        t = time.perf_counter()
        total = synthesise(root, shape, spans_per_part)
        console.print(f"synthesised {total:,} spans, {shape.steps:,} steps "
                      f"in {time.perf_counter() - t:.1f}s under {root}")
        before = measure(root, shape, repeat)
        t = time.perf_counter()
        reports = compact_store(root, grace_s=0)
        compact_s = time.perf_counter() - t
        after = measure(root, shape, repeat)
        same = before.pop("_samples").equals(after.pop("_samples"))
        table = Table(title=f"store of {total:,} spans: before vs after compaction ({compact_s:.1f}s to compact)")
        for c in ("figure", "before", "after", "after / before"):
            table.add_column(c, justify="right" if c != "figure" else "left")
        for key in ("files_spans", "files_rollouts", "count", "samples_rows", "samples_s", "samples_cpu_s",
                    "count_s", "count_cpu_s", "groupby_s", "groupby_cpu_s"):
            b, a = before[key], after[key]
            fmt = "{:.3f}" if key.endswith("_s") else "{:,}"
            table.add_row(key, fmt.format(b), fmt.format(a), f"{a / b:.3f}" if b else "-")
        console.print(table)
        console.print(f"samples identical before/after: {same}; rows compacted: "
                      f"{sum(r.rows_compacted for r in reports.values()):,}")


if __name__ == "__main__":
    main()
