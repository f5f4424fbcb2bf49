"""What a process tree costs per attempt: start+end overhead, launcher CPU while waiting, kill time.

    .venv/bin/python scripts/bench_proctree.py [--n 40]

For each mechanism (cgroup where usable, then the subreaper + /proc scan), through the real
``LocalRunner``: the mean wall time of an attempt running ``/bin/true`` (against plain
``subprocess.run`` of the same), the launcher's CPU seconds while one harness sleeps 3 s, and the
time from the harness's exit to a tree of two escapees (``setsid`` + double fork, tests/support/
harness_escape.py) being gone. Prints one JSON line per mechanism.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lightning_harness.launcher.local import AttemptJob, LocalRunner
from lightning_harness.launcher.proctree import ProcessTree

ESCAPE = Path(__file__).resolve().parent.parent / "tests" / "support" / "harness_escape.py"


def _run(tmp: Path, argv, env=None) -> float:
    job = AttemptJob("bench", 0, argv, env or {}, tmp, tmp / "harness.log")
    t0 = time.perf_counter()
    LocalRunner(kill_grace=0.5).run(job, threading.Event())
    return time.perf_counter() - t0


def measure(n: int, tmp: Path) -> dict:
    mech = ProcessTree.mechanism()
    _run(tmp, ["/bin/true"])  # warm-up
    tree_ms = 1000 * sum(_run(tmp, ["/bin/true"]) for _ in range(n)) / n
    t0 = time.process_time()
    _run(tmp, ["sleep", "3"])
    cpu_s = time.process_time() - t0
    env = {"LIGHTNING_TASK": json.dumps({"escape": True}), "LIGHTNING_OUTPUT_DIR": str(tmp / "out")}
    total = _run(tmp, [sys.executable, str(ESCAPE)], env)
    pids = [int((tmp / "out" / f).read_text().split()[0]) for f in ("setsid.txt", "daemon.txt")]
    alive = [p for p in pids if Path(f"/proc/{p}").exists()
             and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0]]
    return {"mechanism": mech, "attempt_true_ms": round(tree_ms, 2), "cpu_s_while_sleep_3s": round(cpu_s, 3),
            "escape_attempt_s": round(total, 3), "escapees_alive_after": len(alive)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    n = ap.parse_args().n
    t0 = time.perf_counter()
    for _ in range(n):
        subprocess.run(["/bin/true"], start_new_session=True)
    print(json.dumps({"mechanism": "none (subprocess.run)",
                      "attempt_true_ms": round(1000 * (time.perf_counter() - t0) / n, 2)}))
    for mode in ("auto", "scan"):
        ProcessTree._mechanism = None
        if mode == "scan":
            os.environ["LIGHTNING_PROCESS_TREE"] = "scan"
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(measure(n, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
