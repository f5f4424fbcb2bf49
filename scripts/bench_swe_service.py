#!/usr/bin/env python
"""Benchmark the swe example's harness service: the same mini-swe-agent episodes through
``lightning-launch`` (real proxy, real sandbox, the scripted solver as the model), one process per
rollout importing mini-swe-agent itself vs per-rollout commands handing their episode to
``harness.py --serve``. Rounds alternate (process, service) so that load from other jobs hits both
alike; it prints wall time, the machine's busy CPU seconds during the batch (launcher, proxy,
harnesses, sandboxes, reward steps, the service: run it on an otherwise quiet machine), episodes per
minute and the service/process ratios.

    .venv/bin/python scripts/bench_swe_service.py                 # 16 episodes x 2 rounds, -j 4
    .venv/bin/python scripts/bench_swe_service.py --episodes 8 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWE = ROOT / "examples" / "swe"
sys.path.insert(0, str(SWE))
import solver  # noqa: E402

SWE_PY = Path(os.environ.get("LIGHTNING_SWE_PYTHON") or ROOT / ".venv-swe" / "bin" / "python")


def busy_cpu() -> float:
    """CPU seconds the whole machine has spent busy (/proc/stat). Not the batch's children's rusage:
    the service reaps its sandboxes itself and is then killed, which loses their share."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def one_batch(tasks: list[dict], upstream: str, work: Path, service: bool, concurrency: int) -> dict:
    work.mkdir(parents=True)
    task_file = work / "tasks.jsonl"
    task_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    traces = work / "traces"
    cmd = [sys.executable, "-m", "lightning_harness.launcher.cli", "run", str(task_file), "--traces", str(traces),
           "--upstream", upstream, "--served-name", "swe-tiny", "--proxy-confdir", str(work.parent / "conf"),
           "--no-progress", "--timeout", "240", "-j", str(concurrency),
           "--reward-cmd", f"{sys.executable} {SWE / 'reward.py'}"]
    if service:
        cmd += ["--service", f"{SWE_PY} {SWE / 'harness.py'} --serve"]
    cmd += ["--", str(SWE_PY), str(SWE / "harness.py")]
    cpu0, t0 = busy_cpu(), time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    wall, cpu = time.monotonic() - t0, busy_cpu() - cpu0
    if res.returncode != 0:
        raise SystemExit(f"the batch failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    import duckdb

    rows = duckdb.sql(f"SELECT state, reward FROM read_parquet('{traces}/rollouts/**/*.parquet')").fetchall()
    return {"wall_s": wall, "cpu_s": cpu, "episodes": len(rows), "solved": sum(1 for _, r in rows if r == 1.0),
            "per_min": 60 * len(rows) / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", "-j", type=int, default=4)
    a = ap.parse_args()
    tasks = solver.load_tasks([str(SWE / "tasks_train.jsonl")])[: a.episodes]
    work = Path(tempfile.mkdtemp(prefix="bench-swe-service-"))
    got: dict[str, list[dict]] = {"process": [], "service": []}
    for r in range(a.rounds):
        for mode in ("process", "service"):
            # a fresh teacher per batch: its random choices (which files to list, ...) start over
            server = solver.SolverServer(("127.0.0.1", 0), solver.Policy(tasks, solver.Noise.scaled(0.0), seed=0))
            threading.Thread(target=server.serve_forever, daemon=True).start()
            upstream = f"http://127.0.0.1:{server.server_address[1]}"
            x = one_batch(tasks, upstream, work / f"{mode}-{r}", mode == "service", a.concurrency)
            server.shutdown()
            server.server_close()
            got[mode].append(x)
            print(f"round {r + 1} {mode:8s}: {x['episodes']} episodes ({x['solved']} solved) in {x['wall_s']:.1f} s, "
                  f"CPU {x['cpu_s']:.1f} s, {x['per_min']:.1f} episodes/min", flush=True)
    med = {m: {k: statistics.median(x[k] for x in xs) for k in ("wall_s", "cpu_s", "per_min")} for m, xs in got.items()}
    print(f"\n{'':10s}{'wall s':>10s}{'CPU s':>10s}{'CPU s/episode':>15s}{'episodes/min':>14s}")
    for m, x in med.items():
        print(f"{m:10s}{x['wall_s']:10.1f}{x['cpu_s']:10.1f}{x['cpu_s'] / a.episodes:15.2f}{x['per_min']:14.1f}")
    p, s = med["process"], med["service"]
    print(f"service/process: wall {s['wall_s'] / p['wall_s']:.2f}x, CPU {s['cpu_s'] / p['cpu_s']:.2f}x, "
          f"episodes/min {s['per_min'] / p['per_min']:.2f}x (median of {a.rounds} rounds, {a.episodes} episodes, "
          f"-j {a.concurrency}; work dir {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
