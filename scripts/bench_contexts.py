#!/usr/bin/env python
"""The proxy's memory under agent-sized contexts: many calls with ~400 KB requests, compaction on.

A coding agent resends its whole conversation each call, so its requests run to hundreds of KB and
repeat each other. For each kind of context (``equal``: the same request every time, the worst
case for compression; ``distinct``: different words per call; ``code``: a window of this repository's
source, moved per call) it starts a proxy on the stub,
sends ``--calls`` requests at concurrency 16 with the proxy compacting every ``--compact-seconds``,
samples the proxy's RSS every half second, and prints RSS at start, peak and end, the spans on
disk against the calls sent, the store's size and its parts (readers' view; the files
include replaced parts waiting out their grace period).

    .venv/bin/python scripts/bench_contexts.py                  # 3,000 calls of each kind (~3 min)
    .venv/bin/python scripts/bench_contexts.py --calls 600 --kinds equal
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]

from bench_proxy import rss_mib  # noqa: E402
from bench_proxy_ab import source_text  # noqa: E402

from lightning_harness.proxy.client import ProxyProcess  # noqa: E402
from lightning_harness.schemas import finished_parts, read_table  # noqa: E402


def request(kind: str, i: int, size: int) -> bytes:
    if kind == "code":  # what a coding agent resends: source it has read (this repository's), per call a new window
        code = source_text(2 * size)
        start = (i * 7919) % (len(code) - size)
        text = code[start:start + size]
    else:
        rnd = random.Random(0 if kind == "equal" else i)
        text = " ".join(f"w{rnd.randrange(5000)}" for _ in range(size // 6))
    return json.dumps({"model": "gpt-4o", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}).encode()


def run(kind: str, a, work: Path, stub_url: str) -> dict:
    traces = work / f"traces-{kind}"
    p = ProxyProcess(traces, upstreams=[stub_url], route_hosts=["api.openai.com"], confdir=work / "conf",
                     log_path=work / f"proxy-{kind}.log", compact_seconds=a.compact_seconds).start()
    url = p.env_for(f"ctx-{kind}")["OPENAI_BASE_URL"] + "/chat/completions"
    start, peak, done = rss_mib(p.pid), [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            peak[0] = max(peak[0], rss_mib(p.pid))

    threading.Thread(target=sample, daemon=True).start()
    local = threading.local()

    def call(i: int) -> int:
        if not hasattr(local, "client"):
            local.client = httpx.Client(trust_env=False, timeout=120)
        return local.client.post(url, content=request(kind, i, a.size),
                                 headers={"Content-Type": "application/json"}).status_code

    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as ex:
        codes = list(ex.map(call, range(a.calls)))
    sent = time.monotonic() - t0
    time.sleep(a.compact_seconds + 5)  # one more compaction after the last call
    done.set()
    end = rss_mib(p.pid)
    p.stop()
    spans = read_table(traces, "spans").num_rows
    files = list((traces / "spans").glob("**/*.parquet"))
    return {"kind": kind, "calls": a.calls, "ok": sum(c == 200 for c in codes), "spans": spans, "seconds": sent,
            "rss_start": start, "rss_peak": max(peak[0], end), "rss_end": end,
            "store_mb": sum(f.stat().st_size for f in files) / 1e6, "files": len(files),
            "parts": len(finished_parts(traces, "spans")[0])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--size", type=int, default=400_000, help="bytes of context per request")
    ap.add_argument("--kinds", nargs="+", choices=["equal", "distinct", "code"], default=["equal", "distinct"])
    ap.add_argument("--compact-seconds", type=float, default=10.0)
    a = ap.parse_args()
    from fixtures_proxy import StubServer

    work = Path(tempfile.mkdtemp(prefix="bench-contexts-"))
    stub = StubServer(work)
    rows = [run(kind, a, work, stub.url) for kind in a.kinds]
    t = Table(title=f"proxy RSS under {a.size // 1000} KB contexts, concurrency 16, compaction every "
                    f"{a.compact_seconds:g} s")
    for col in ("contexts", "calls (200)", "spans on disk", "calls/s", "RSS start", "RSS peak", "RSS end",
                "spans store", "parts read (files)"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["kind"], f"{r['calls']} ({r['ok']})", str(r["spans"]), f"{r['calls'] / r['seconds']:.0f}",
                  f"{r['rss_start']:.0f} MiB", f"{r['rss_peak']:.0f} MiB", f"{r['rss_end']:.0f} MiB",
                  f"{r['store_mb']:.1f} MB", f"{r['parts']} ({r['files']})")
    Console().print(t)
    print(f"work dir: {work}")
    return 0 if all(r["spans"] == r["ok"] == r["calls"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
