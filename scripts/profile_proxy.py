#!/usr/bin/env python
"""Where the proxy's CPU goes on streamed answers: py-spy profiles of two settings, side by side.

Two processes on one stub under the same load (SSE, ``--sse-tokens`` chunks, concurrency 16; or, with
``--context KB``, JSON calls carrying KB kilobytes of source code, as a coding agent sends): A is
the proxy with ``--a`` options, B the proxy with ``--b`` options, or plain mitmproxy with ``--b
plain``. Each is sampled by py-spy in GIL mode (only the thread running Python counts): without it a
thread waiting for the GIL is sampled where it waits, and mitmproxy's per-chunk functions looked up
to three times costlier next to the span writer's thread than they are. It prints the CPU per request
(/proc), then the functions whose time per request differs most (inclusive and self, ms a request),
and the same summed by package (ours, mitmproxy, asyncio, pyarrow, ...).

    pip install py-spy   # into the environment running this script
    .venv/bin/python scripts/profile_proxy.py --b inject_token_ids=false   # what injecting costs
    .venv/bin/python scripts/profile_proxy.py --b plain --seconds 20        # the proxy vs mitmproxy
    .venv/bin/python scripts/profile_proxy.py --b plain --b-asks            # ... relaying the same stream
    .venv/bin/python scripts/profile_proxy.py --b plain --context 400       # agent-sized calls
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]

from bench_proxy import PlainMitmproxy, Target, load, measure  # noqa: E402
from bench_proxy_ab import options, request_body  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from lightning_harness.proxy.client import ProxyProcess  # noqa: E402

FRAME = re.compile(r"(?P<fn>.*) \((?P<file>[^()]*?):\d+\)$")
PACKAGES = ("lightning_harness", "mitmproxy", "asyncio", "pyarrow", "h11", "threading", "logging")


def frame_name(frame: str) -> tuple[str, str]:
    """``'send (/x/site-packages/mitmproxy/a/b.py:12)'`` -> ``('send (mitmproxy/a/b.py)', 'mitmproxy')``."""
    m = FRAME.match(frame)
    if not m:
        return frame, "other"
    file = m["file"]
    if "site-packages/" in file:
        path = file.split("site-packages/")[-1]
    elif file.startswith(f"{ROOT}/"):  # the checkout (installed editable)
        path = "lightning_harness/" + file[len(str(ROOT)) + 1:]
    else:  # the standard library
        path = re.sub(r"^.*/lib/python3[.0-9]*/", "", file)
    top = path.split("/")[0].removesuffix(".py")
    return f"{m['fn']} ({path})", top if top in PACKAGES else "other"


def aggregate(raw: str) -> tuple[Counter, Counter, Counter, int]:
    """py-spy ``--format raw`` lines (``frame;frame;... count``, outermost first) -> samples per
    function inclusive, per function self, per package self, and the total."""
    incl, self_, pkg, total = Counter(), Counter(), Counter(), 0
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        names = [frame_name(f) for f in stack.split(";") if not f.startswith(("thread ", "process "))]
        if not names:
            continue
        total += int(n)
        for name in {fn for fn, _ in names}:
            incl[name] += int(n)
        self_[names[-1][0]] += int(n)
        pkg[names[-1][1]] += int(n)
    return incl, self_, pkg, total


def profile(pyspy: str, pid: int, target: Target, body: bytes, seconds: float, rate: int, out: Path) -> dict:
    """Load ``target`` for ``seconds`` while py-spy samples ``pid``; the load's figures + the samples."""
    spy = subprocess.Popen([pyspy, "record", "--gil", "--threads", "--full-filenames", "-r", str(rate),
                            "-d", str(int(seconds) + 2), "-f", "raw", "-o", str(out), "-p", str(pid)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attached before the clock starts
    x = measure(target, pid, 16, seconds, body)
    _, err = spy.communicate()
    if spy.returncode != 0 or not out.exists():
        raise SystemExit(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-400:]}")
    x["agg"] = aggregate(out.read_text())
    return x


def table(title: str, a: Counter, b: Counter, per_a: float, per_b: float, rows: int, what: str = "function") -> Table:
    t = Table(title=title)
    for col in ("A ms/req", "B ms/req", "A - B", what):
        t.add_column(col, justify="right" if "ms" in col or "-" in col else "left")
    keys = sorted(set(a) | set(b), key=lambda k: -abs(a[k] * per_a - b[k] * per_b))
    for k in keys[:rows]:
        t.add_row(f"{a[k] * per_a:.3f}", f"{b[k] * per_b:.3f}", f"{a[k] * per_a - b[k] * per_b:+.3f}", k[:110])
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", nargs="*", default=[], help="proxy options of A (KEY=VALUE ...), or 'plain' (mitmdump)")
    ap.add_argument("--b", nargs="*", default=["plain"], help="proxy options of B, or 'plain' (mitmdump)")
    ap.add_argument("--seconds", type=float, default=12.0, help="load per side while sampling")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--sse-tokens", type=int, default=50)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--context", type=int, default=0, metavar="KB", help="JSON calls with KB kilobytes of source code")
    ap.add_argument("--b-asks", action="store_true",
                    help="B's calls ask for token ids and logprobs themselves: with --b plain, mitmproxy relays the "
                         "very stream the proxy gets by injecting (the profile of our work on equal bytes)")
    a = ap.parse_args()
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        raise SystemExit("py-spy not found: pip install py-spy (into the environment running this script)")
    from fixtures_proxy import StubServer

    work = Path(tempfile.mkdtemp(prefix="profile-proxy-"))
    body = request_body(a.sse_tokens, a.context)
    bodies = {"A": body, "B": json.dumps({**json.loads(body), "return_token_ids": True, "logprobs": True}).encode()
              if a.b_asks else body}
    stub, procs, targets = StubServer(work), {}, {}
    console = Console()
    try:
        for side, opts in (("A", a.a), ("B", a.b)):
            if opts == ["plain"]:
                procs[side] = PlainMitmproxy(stub.url, work)
                targets[side] = Target(procs[side].url)
                continue
            procs[side] = ProxyProcess(work / f"traces-{side}", upstreams=[stub.url], route_hosts=["api.openai.com"],
                                       confdir=work / "conf", log_path=work / f"proxy-{side}.log",
                                       **options(opts, f"--{side.lower()}")).start()
            targets[side] = Target(procs[side].env_for("profile")["OPENAI_BASE_URL"])
        res = {}
        for side in ("A", "B"):
            load(targets[side], 4, total=300, body=bodies[side])  # warm up
            console.print(f"[dim]profiling {side} for {a.seconds:g} s ...[/dim]")
            res[side] = profile(pyspy, procs[side].pid, targets[side], bodies[side], a.seconds, a.rate,
                                work / f"{side}.txt")
        ms = {s: 1000.0 / a.rate / max(1, res[s]["requests"]) for s in res}  # ms a request per sample
        for s, opts in (("A", a.a), ("B", a.b)):
            r = res[s]
            console.print(f"{s} {' '.join(opts) or '(defaults)'}: {r['requests']} requests, "
                          f"{r['cpu_ms_per_req']:.2f} ms CPU/request (/proc), {r['agg'][3] * ms[s]:.2f} ms sampled "
                          "(wall time of Python holding the GIL: a process descheduled meanwhile counts; "
                          "the kernel and C code that releases the GIL do not)")
        (ia, sa, pa, ta), (ib, sb, pb, tb) = res["A"]["agg"], res["B"]["agg"]
        console.print(table("by package (self time)", pa, pb, ms["A"], ms["B"], len(PACKAGES) + 1, "package"))
        roots = {k for inc, total in ((ia, ta), (ib, tb)) for k in inc if inc[k] >= 0.9 * total}
        ia, ib = (Counter({k: v for k, v in inc.items() if k not in roots}) for inc in (ia, ib))  # loop, click
        console.print(table("functions, inclusive", ia, ib, ms["A"], ms["B"], a.rows))
        console.print(table("functions, self", sa, sb, ms["A"], ms["B"], a.rows))
        console.print(f"[dim]raw profiles: {work}/A.txt, {work}/B.txt[/dim]")
    finally:
        for p in procs.values():
            p.stop()
        stub.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
