#!/usr/bin/env python
"""Compare two settings of the proxy on streamed answers (or agent-sized requests): two proxies side
by side on one stub.

Each ``--a``/``--b`` is a list of proxy options (``KEY=VALUE``, the names of ``lightning-proxy serve``'s
YAML keys). The rounds alternate A and B (B first every other round) so that this machine's drift
falls on both; it prints each round's CPU per request, the medians, the median of the per-round
ratios B/A, and each proxy's resident memory at the end and at its peak. Use it for a change whose
effect is smaller than the run-to-run noise of ``bench_proxy.py`` (which compares against plain
mitmproxy, one run at a time).

``--a-rev``/``--b-rev`` run that side from a git revision of the proxy's code instead of the
working tree (a change's effect: ``--a-rev HEAD``). ``--together`` loads A and B at the same time
instead of in turns: both then see the same moment of a shared machine, which narrows the spread
of the ratios (each proxy gets less CPU than alone, so absolute figures are not the alternating ones).
``--context KB`` sends what a coding agent sends instead: a JSON call (not streamed) whose message
holds KB kilobytes of source code (this repository's), as an agent resends the files it has read.

    .venv/bin/python scripts/bench_proxy_ab.py --a gc_young=700 --b gc_young=10000
    .venv/bin/python scripts/bench_proxy_ab.py --a inject_token_ids=false --rounds 12
    .venv/bin/python scripts/bench_proxy_ab.py --a-rev HEAD~1 --together --rounds 20
    .venv/bin/python scripts/bench_proxy_ab.py --a-rev HEAD~1 --context 400 --concurrency 4
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]

from bench_proxy import Target, load, measure, measure_together, rss_mib  # noqa: E402

from lightning_harness.proxy.client import ProxyProcess  # noqa: E402
from lightning_harness.proxy.config import parse_pairs  # noqa: E402


def options(pairs: list[str], flag: str) -> dict:
    """``["gc_young=700"]`` -> ``{"gc_young": 700}`` (values read as YAML scalars)."""
    try:
        return {k: yaml.safe_load(v) for k, v in parse_pairs(pairs, flag).items()}
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


PACKAGES = ("proxy", "schemas", "launcher", "trainer")  # lightning_harness.<name> lives in <name>/


def source_tree(rev: str, dest: Path) -> Path:
    """The package at git revision ``rev``, importable from the returned folder (``PYTHONPATH``)."""
    src = dest / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "lightning_harness", *PACKAGES],
                             capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"git archive {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    pkg = src / "lightning_harness"
    for name in PACKAGES:
        (pkg / name).symlink_to(src / name)
    return src


@functools.cache
def source_text(size: int) -> str:
    """``size`` characters of this repository's source (``$ cat <file>`` and its text, repeated as
    needed): what a coding agent resends once it has read the files."""
    code, files = "", sorted(p for name in PACKAGES for p in (ROOT / name).rglob("*.py"))
    while len(code) < size:
        code += "".join(f"$ cat {f.relative_to(ROOT)}\n{f.read_text()}\n" for f in files)
    return code[:size]


def request_body(sse_tokens: int, context_kb: int) -> bytes:
    """A short streamed chat call, or (``context_kb``) a JSON call carrying that much source code."""
    if not context_kb:
        return json.dumps({"model": "gpt-4o", "max_tokens": sse_tokens, "stream": True,
                           "messages": [{"role": "system", "content": "You are terse."},
                                        {"role": "user", "content": "Say something short, please."}]}).encode()
    return json.dumps({"model": "gpt-4o", "max_tokens": 16,
                       "messages": [{"role": "user", "content": source_text(context_kb * 1000)}]}).encode()


def together(targets: dict, procs: dict, concurrency: int, seconds: float, body: bytes) -> dict[str, float]:
    """CPU per request of every side, all loaded at once for ``seconds``."""
    got = measure_together([(targets[n], p.pid, body) for n, p in procs.items()], concurrency, seconds)
    return {n: x["cpu_ms_per_req"] for n, x in zip(procs, got)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", nargs="*", default=[], help="proxy options of A (KEY=VALUE ...)")
    ap.add_argument("--b", nargs="*", default=[], help="proxy options of B (KEY=VALUE ...)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0, help="measurement time per round and proxy")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--sse-tokens", type=int, default=50, help="chunks per streamed answer")
    ap.add_argument("--a-rev", help="run A from this git revision (default: the working tree)")
    ap.add_argument("--b-rev", help="run B from this git revision (default: the working tree)")
    ap.add_argument("--together", action="store_true", help="load A and B at the same time, not in turns")
    ap.add_argument("--context", type=int, default=0, metavar="KB",
                    help="send JSON calls with KB kilobytes of source code instead of streamed ones")
    a = ap.parse_args()

    from fixtures_proxy import StubServer

    work = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    body = request_body(a.sse_tokens, a.context)
    stub = StubServer(work)
    sides = {"A": options(a.a, "--a"), "B": options(a.b, "--b")}
    procs = {}
    revs = {"A": a.a_rev, "B": a.b_rev}
    os.chdir(work)  # `python -m` puts the working folder first on sys.path: the repository's would win
    try:
        for name, opts in sides.items():
            env = dict(os.environ)
            if revs[name]:
                env["PYTHONPATH"] = str(source_tree(revs[name], work / f"rev-{name}"))
            procs[name] = ProxyProcess(work / f"traces-{name}", upstreams=[stub.url], route_hosts=["api.openai.com"],
                                       confdir=work / "conf", log_path=work / f"proxy-{name}.log", env=env,
                                       **opts).start()
        targets = {n: Target(p.env_for("bench")["OPENAI_BASE_URL"]) for n, p in procs.items()}
        for name in sides:
            load(targets[name], 4, total=300, body=body)  # warm up
        cpu: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(a.rounds):
            if a.together:
                got = together(targets, procs, a.concurrency, a.seconds, body)
            else:
                got = {name: measure(targets[name], procs[name].pid, a.concurrency, a.seconds, body)["cpu_ms_per_req"]
                       for name in (("A", "B") if r % 2 == 0 else ("B", "A"))}
            for name, x in got.items():
                cpu[name].append(x)
            print(f"round {r + 1}/{a.rounds}: A {cpu['A'][-1]:.2f}  B {cpu['B'][-1]:.2f} ms CPU/request", flush=True)
        how = "rounds loading both at once" if a.together else "alternating rounds"
        load_kind = f"JSON calls of {a.context} KB" if a.context else f"SSE x{a.sse_tokens}"
        print(f"\n{load_kind}, concurrency {a.concurrency} each, {a.rounds} {how} of {a.seconds:g} s")
        for name, opts in sides.items():
            rss, peak = rss_mib(procs[name].pid), rss_mib(procs[name].pid, "VmHWM")
            what = f"{opts or '(defaults)'} at {revs[name] or 'the working tree'}"
            print(f"  {name} {what}: median {statistics.median(cpu[name]):.2f} ms CPU/request, "
                  f"RSS {rss:.0f} MiB (peak {peak:.0f})")
        ratios = [b / x for x, b in zip(cpu["A"], cpu["B"])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(f"  B/A: median of the rounds' ratios {statistics.median(ratios):.3f} (middle half "
              f"{q[0]:.3f}-{q[2]:.3f}, range {min(ratios):.3f}-{max(ratios):.3f}); ratio of the medians "
              f"{statistics.median(cpu['B']) / statistics.median(cpu['A']):.3f}")
    finally:
        for p in procs.values():
            p.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
