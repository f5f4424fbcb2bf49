"""Benchmark: spans -> samples throughput of ``build_samples`` on synthetic multi-turn traces.

Generates ``--spans`` spans (rollouts of ``--calls`` calls; each call adds a response of 100-300
tokens and a tool result of 50-150 tokens to a conversation that starts with a ``--system``-token
prompt; a share ``--break-rate`` of calls gets a re-tokenised history so merging is exercised),
writes them as Parquet with ``schemas.PartWriter``, then times ``build_samples`` end to end (DuckDB
scan and join, merge test, assembly, advantages, weights). Baseline measured in the same run: a
plain ``pyarrow`` read of the same spans (the cost of just decoding the token ids).

    .venv/bin/python scripts/bench_samples.py                 # 100,000 spans
    .venv/bin/python scripts/bench_samples.py --spans 20000   # quicker

Target (issue 4): >= 20,000 spans/s on 2 cores.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.table import Table

from lightning_harness.schemas import SPANS, PartWriter, read_table


def _seg_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    out_starts = np.cumsum(lens) - lens
    return np.repeat(starts - out_starts, lens) + np.arange(int(lens.sum()), dtype=np.int64)


def _list(values: np.ndarray, lens: np.ndarray, typ: pa.DataType) -> pa.ListArray:
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32 if len(values) < 2**31 else np.int64)
    arr_cls = pa.ListArray if off.dtype == np.int32 else pa.LargeListArray
    return arr_cls.from_arrays(pa.array(off), pa.array(values, typ)).cast(pa.list_(typ))


def generate(root: Path, n_spans: int, calls: int, system: int, break_rate: float, seed: int = 0,
             part_rollouts: int = 1000) -> dict:
    """Write synthetic spans + rollouts under root; returns token counts."""
    rng = np.random.default_rng(seed)
    n_roll = max(1, n_spans // calls)
    t0 = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
    totals = {"spans": 0, "prompt_tokens": 0, "response_tokens": 0}
    with PartWriter(root, "rollouts", background=False, fsync=False) as rw:
        rw.extend(
            {"rollout_id": f"r{r:06d}", "attempt": 0, "task_id": f"t{r // 8}", "group_id": f"t{r // 8}@0",
             "step": 0, "state": "succeeded", "reward": float(rng.random() < 0.5)}
            for r in range(n_roll)
        )
    writer = PartWriter(root, "spans", background=False, fsync=False)
    for r0 in range(0, n_roll, part_rollouts):
        nr = min(part_rollouts, n_roll - r0)
        resp = rng.integers(100, 301, (nr, calls))
        ctx = rng.integers(50, 151, (nr, calls))
        step = resp + ctx
        plen = system + np.concatenate([np.zeros((nr, 1), np.int64), np.cumsum(step, axis=1)[:, :-1]], axis=1)
        conv_len = system + step.sum(axis=1)
        conv_off = np.concatenate([[0], np.cumsum(conv_len)])
        conv = rng.integers(0, 150_000, int(conv_off[-1]), dtype=np.int32)
        starts = np.repeat(conv_off[:-1], calls)
        pl, rl = plen.reshape(-1), resp.reshape(-1)
        p_vals = conv[_seg_index(starts, pl)]
        r_vals = conv[_seg_index(starts + pl, rl)]
        # re-tokenised histories: flip one token inside the previous response of some calls
        k = np.tile(np.arange(calls), nr)
        brk = np.flatnonzero((k > 0) & (rng.random(nr * calls) < break_rate))
        if len(brk):
            p_off = np.concatenate([[0], np.cumsum(pl)])
            p_vals[p_off[brk] + pl[brk - 1] + 1] ^= 1
        lps = (-rng.exponential(0.5, len(r_vals))).astype(np.float32)
        n = nr * calls
        rid = np.repeat(np.array([f"r{r:06d}" for r in range(r0, r0 + nr)], dtype=object), calls)
        ts = pa.array([t0 + dt.timedelta(milliseconds=int(i)) for i in range(n)], pa.timestamp("us", tz="UTC"))
        cols = {
            "span_id": pa.array([f"s{r0:06d}-{i:07d}" for i in range(n)]),
            "rollout_id": pa.array(rid.tolist()),
            "attempt": pa.array(np.zeros(n, np.int32)),
            "seq": pa.array(k.astype(np.int32)),
            "started_at": ts,
            "ended_at": ts,
            "latency_ms": pa.array(rng.gamma(2.0, 200.0, n)),
            "endpoint": pa.array(["chat.completions"] * n),
            "upstream": pa.array(["http://127.0.0.1:8000/v1"] * n),
            "model_version": pa.array(np.zeros(n, np.int64)),
            "status_code": pa.array(np.full(n, 200, np.int32)),
            "prompt_token_ids": _list(p_vals, pl, pa.int32()),
            "response_token_ids": _list(r_vals, rl, pa.int32()),
            "response_logprobs": _list(lps, rl, pa.float32()),
            "finish_reason": pa.array(["stop"] * n),
            "prompt_tokens": pa.array(pl.astype(np.int32)),
            "completion_tokens": pa.array(rl.astype(np.int32)),
        }
        arrays = [cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in SPANS]
        writer.write_table(pa.Table.from_arrays(arrays, schema=SPANS))
        totals["spans"] += n
        totals["prompt_tokens"] += int(pl.sum())
        totals["response_tokens"] += int(rl.sum())
    writer.close()
    return totals


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--spans", "n_spans", default=100_000, show_default=True, help="Number of synthetic spans.")
@click.option("--calls", default=8, show_default=True, help="Calls per rollout.")
@click.option("--system", default=200, show_default=True, help="Tokens of the first prompt.")
@click.option("--break-rate", default=0.05, show_default=True, help="Share of calls with a re-tokenised history.")
@click.option("--threads", default=2, show_default=True, help="DuckDB threads (the target is for 2 cores).")
@click.option("--repeat", default=3, show_default=True, help="Timed builds; the fastest is reported.")
@click.option("--dir", "folder", type=click.Path(file_okay=False), default=None,
              help="Keep the traces here (default: a temp dir).")
def main(n_spans: int, calls: int, system: int, break_rate: float, threads: int, repeat: int,
         folder: str | None) -> None:
    """Time build_samples on synthetic traces; print spans/s and tokens/s."""
    from lightning_harness.trainer.samples import build_samples
    from lightning_harness.trainer.views import connect

    console = Console()
    with tempfile.TemporaryDirectory(prefix="lh-bench-samples-") as tmp:
        root = Path(folder or tmp)
        with console.status(f"generating {n_spans:,} spans ..."):
            t = time.perf_counter()
            totals = generate(root, n_spans, calls, system, break_rate)
            gen_s = time.perf_counter() - t
        size = sum(p.stat().st_size for p in (root / "spans").rglob("*.parquet"))
        console.print(f"generated {totals['spans']:,} spans, "
                      f"{totals['prompt_tokens'] + totals['response_tokens']:,} tokens "
                      f"({size / 2**20:.0f} MiB Parquet) in {gen_s:.1f}s")

        t = time.perf_counter()
        raw = read_table(root, "spans")
        read_s = time.perf_counter() - t
        del raw

        with console.status("building samples ..."):
            best = None
            for _ in range(repeat):
                con = connect(root, threads=threads)
                t, c = time.perf_counter(), time.process_time()
                table, stats = build_samples(con)
                run = (time.perf_counter() - t, time.process_time() - c, stats)
                best = run if best is None or run[0] < best[0] else best
                del table, con
            build_s, build_cpu, stats = best
        tokens = totals["prompt_tokens"] + totals["response_tokens"]
        out = Table(title=f"build_samples on {totals['spans']:,} spans "
                          f"({threads} DuckDB threads, {os.cpu_count()} CPUs)")
        for col in ("what", "seconds", "spans/s", "tokens/s"):
            out.add_column(col, justify="right" if col != "what" else "left")
        out.add_row("baseline: pyarrow read of spans", f"{read_s:.2f}", f"{totals['spans'] / read_s:,.0f}",
                    f"{tokens / read_s:,.0f}")
        out.add_row(f"build_samples (end to end, best of {repeat})", f"{build_s:.2f}",
                    f"{totals['spans'] / build_s:,.0f}", f"{tokens / build_s:,.0f}")
        out.add_row("  CPU seconds (all threads) of that build", f"{build_cpu:.2f}",
                    f"{totals['spans'] / build_cpu:,.0f}", f"{tokens / build_cpu:,.0f}")
        console.print(out)
        console.print(f"phases (wall s): {stats['timings_s']}")
        load = os.getloadavg()[0]
        shared = " [yellow](shared machine: wall times inflated)[/]" if load > os.cpu_count() else ""
        console.print(f"load average {load:.1f} on {os.cpu_count()} CPUs{shared}")
        console.print(f"build / read time ratio: {build_s / read_s:.2f}x;  samples: {stats['samples']:,}, "
                      f"samples/rollout {stats['samples_per_rollout']:.2f}, breaks {stats['breaks']}")
        rate = totals["spans"] / build_s
        verdict = "[green]meets[/]" if rate >= 20_000 else "[red]misses[/]"
        console.print(f"target >= 20,000 spans/s: {verdict} ({rate:,.0f} spans/s wall; "
                      f"{totals['spans'] / build_cpu:,.0f} spans per CPU-second, "
                      "the figure a loaded machine cannot distort upward)")


if __name__ == "__main__":
    main()
