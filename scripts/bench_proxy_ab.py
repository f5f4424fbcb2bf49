#!/usr/bin/env python
"""Compare two settings of the proxy on streamed answers: two proxies side by side on one stub.

Each ``--a``/``--b`` is a list of proxy options (``KEY=VALUE``, the names of ``lightning-proxy serve``'s
YAML keys). The rounds alternate A and B (B first every other round) so that this machine's drift
falls on both; it prints each round's CPU per request, the medians, the median of the per-round
ratios B/A, and each proxy's resident memory at the end and at its peak. Use it for a change whose
effect is smaller than the run-to-run noise of ``bench_proxy.py`` (which compares against plain
mitmproxy, one run at a time).

    .venv/bin/python scripts/bench_proxy_ab.py --a gc_young=700 --b gc_young=10000
    .venv/bin/python scripts/bench_proxy_ab.py --a inject_token_ids=false --rounds 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]

from bench_proxy import Target, load, measure, rss_mib  # noqa: E402

from lightning_harness.proxy.client import ProxyProcess  # noqa: E402
from lightning_harness.proxy.config import parse_pairs  # noqa: E402


def options(pairs: list[str], flag: str) -> dict:
    """``["gc_young=700"]`` -> ``{"gc_young": 700}`` (values read as YAML scalars)."""
    try:
        return {k: yaml.safe_load(v) for k, v in parse_pairs(pairs, flag).items()}
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", nargs="*", default=[], help="proxy options of A (KEY=VALUE ...)")
    ap.add_argument("--b", nargs="*", default=[], help="proxy options of B (KEY=VALUE ...)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0, help="measurement time per round and proxy")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--sse-tokens", type=int, default=50, help="chunks per streamed answer")
    a = ap.parse_args()

    from fixtures_proxy import StubServer

    work = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    body = json.dumps({"model": "gpt-4o", "max_tokens": a.sse_tokens, "stream": True,
                       "messages": [{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": "Say something short, please."}]}).encode()
    stub = StubServer(work)
    sides = {"A": options(a.a, "--a"), "B": options(a.b, "--b")}
    procs = {}
    try:
        for name, opts in sides.items():
            procs[name] = ProxyProcess(work / f"traces-{name}", upstreams=[stub.url], route_hosts=["api.openai.com"],
                                       confdir=work / "conf", log_path=work / f"proxy-{name}.log", **opts).start()
        targets = {n: Target(p.env_for("bench")["OPENAI_BASE_URL"]) for n, p in procs.items()}
        for name in sides:
            load(targets[name], 4, total=300, body=body)  # warm up
        cpu: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(a.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                x = measure(targets[name], procs[name].pid, a.concurrency, a.seconds, body)
                cpu[name].append(x["cpu_ms_per_req"])
            print(f"round {r + 1}/{a.rounds}: A {cpu['A'][-1]:.2f}  B {cpu['B'][-1]:.2f} ms CPU/request", flush=True)
        print(f"\nSSE x{a.sse_tokens}, concurrency {a.concurrency}, {a.rounds} alternating rounds of {a.seconds:g} s")
        for name, opts in sides.items():
            rss, peak = rss_mib(procs[name].pid), rss_mib(procs[name].pid, "VmHWM")
            print(f"  {name} {opts or '(defaults)'}: median {statistics.median(cpu[name]):.2f} ms CPU/request, "
                  f"RSS {rss:.0f} MiB (peak {peak:.0f})")
        ratios = [b / x for x, b in zip(cpu["A"], cpu["B"])]
        print(f"  B/A: median of the rounds' ratios {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}); ratio of the medians "
              f"{statistics.median(cpu['B']) / statistics.median(cpu['A']):.3f}")
    finally:
        for p in procs.values():
            p.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
