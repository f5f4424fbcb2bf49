#!/usr/bin/env python
"""Benchmark the capture proxy: direct vs through the proxy, against the same fast stub, in one run.

For each concurrency (default 1, 16, 64) it measures req/s and p50/p99 latency straight to the
stub upstream and through ``lightning-proxy serve`` (capture to Parquet and token-id injection +
stripping on), prints both and their ratios, the proxy process's CPU time per request (from
/proc), and its RSS before and after a long run (20,000 requests by default). ``--proxies N``
also measures aggregate throughput with N proxy processes (workers spread across them).

Against plain mitmproxy (``mitmdump`` in reverse mode, streaming on for event streams, same stub,
same run) it measures JSON at ``--plain-json-concurrency`` (default 1) and streamed SSE answers
(``--sse-tokens`` chunks, default 50) at ``--sse-concurrency`` (default 16): CPU per request,
p50, time to first byte, and the proxy/plain ratios the targets are stated in. The "same bytes" rows
send plain mitmproxy the request with token ids and logprobs asked for, so that it relays the very
answer or stream the proxy receives: the part of the ratio that is our work, not the bigger answer.
``--bare`` adds a row for a second proxy with token-id injection off on the very stream plain
mitmproxy gets: what capture and recording cost without the bigger stream and its stripping.

The load generator is a small asyncio HTTP/1.1 keep-alive client (one connection per worker,
opened before the clock starts) so that it costs far less CPU than the proxy it measures.

    .venv/bin/python scripts/bench_proxy.py            # full run (~3 min on 2 cores)
    .venv/bin/python scripts/bench_proxy.py --quick    # ~30 s smoke run
    .venv/bin/python scripts/bench_proxy.py --only-plain   # just the proxy vs plain mitmproxy table
    .venv/bin/python scripts/bench_proxy.py --only-plain --bare --seconds 3 --rounds 5   # + where the SSE gap is
    .venv/bin/python scripts/bench_proxy.py --only-plain --bare --together --rounds 7    # a busy machine: both at once
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from lightning_harness.proxy.client import ProxyProcess  # noqa: E402

console = Console(stderr=True)
CLK = os.sysconf("SC_CLK_TCK")


# -- process metrics from /proc ------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime + stime


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of ``pid`` in MiB (``field="VmHWM"``: its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- load generator -------------------------------------------------------------------------------
class Target:
    """Where requests go: ``url`` (a base ending in /v1) and, for forward mode, a proxy."""

    def __init__(self, url: str, proxy: str | None = None) -> None:
        self.url = url.rstrip("/") + "/chat/completions"
        u = urllib.parse.urlsplit(proxy or self.url)
        self.host, self.port = u.hostname, u.port
        self.path = self.url if proxy else urllib.parse.urlsplit(self.url).path
        self.proxy_auth = None
        if proxy and u.username:
            import base64

            cred = f"{urllib.parse.unquote(u.username)}:{urllib.parse.unquote(u.password or '')}"
            self.proxy_auth = base64.b64encode(cred.encode()).decode()

    def request_bytes(self, body: bytes) -> bytes:
        host = urllib.parse.urlsplit(self.url).netloc
        lines = [f"POST {self.path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
                 "Authorization: Bearer sk-bench", f"Content-Length: {len(body)}"]
        if self.proxy_auth:
            lines.append(f"Proxy-Authorization: Basic {self.proxy_auth}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(r: asyncio.StreamReader, t0: float = 0.0, firsts: list | None = None) -> int:
    head = await r.readuntil(b"\r\n\r\n")
    if firsts is not None:
        firsts.append(time.perf_counter() - t0)
    status = int(head.split(b" ", 2)[1])
    low = head.lower()
    if b"transfer-encoding: chunked" in low:
        while True:
            size = int((await r.readline()).split(b";")[0].strip(), 16)
            await r.readexactly(size + 2)
            if size == 0:
                break
    else:
        i = low.find(b"content-length:")
        n = int(low[i + 15 : low.find(b"\r\n", i)].strip()) if i >= 0 else 0
        await r.readexactly(n)
    return status


async def run_load(target: Target, concurrency: int, *, seconds: float | None = None, total: int | None = None,
                   body: bytes, progress=None) -> dict:
    payload = target.request_bytes(body)
    conns = [await asyncio.open_connection(target.host, target.port) for _ in range(concurrency)]
    lat: list[float] = []
    firsts: list[float] = []  # time to the response head
    errors = 0
    issued = 0
    t_end = None
    start = time.perf_counter()
    if seconds is not None:
        t_end = start + seconds

    async def worker(r, w):
        nonlocal errors, issued
        while True:
            if t_end is not None and time.perf_counter() >= t_end:
                return
            if total is not None:
                if issued >= total:
                    return
            issued += 1
            t0 = time.perf_counter()
            w.write(payload)
            status = await _read_response(r, t0, firsts)
            lat.append(time.perf_counter() - t0)
            if status != 200:
                errors += 1
            if progress is not None:
                progress()

    await asyncio.gather(*(worker(r, w) for r, w in conns))
    elapsed = time.perf_counter() - start
    for _, w in conns:
        w.close()
    lat.sort()
    firsts.sort()
    n = len(lat)
    return {
        "ttfb_p50_ms": 1000 * firsts[len(firsts) // 2] if firsts else float("nan"),
        "requests": n,
        "errors": errors,
        "seconds": elapsed,
        "rps": n / elapsed if elapsed else 0.0,
        "p50_ms": 1000 * lat[n // 2] if n else float("nan"),
        "p99_ms": 1000 * lat[min(n - 1, int(n * 0.99))] if n else float("nan"),
    }


def load(target, concurrency, **kw) -> dict:
    return asyncio.run(run_load(target, concurrency, **kw))


# -- plain mitmproxy, the baseline -------------------------------------------------------------------
STREAM_SSE_ADDON = """
class StreamEventStreams:
    def responseheaders(self, flow):
        if "text/event-stream" in flow.response.headers.get("Content-Type", ""):
            flow.response.stream = True

addons = [StreamEventStreams()]
"""


class PlainMitmproxy:
    """``mitmdump`` (the proxy's environment) in reverse mode to the stub: no addons of ours, event
    streams relayed as they come (``flow.response.stream = True``), nothing recorded."""

    def __init__(self, upstream: str, work: Path, args: tuple[str, ...] = ()) -> None:
        import subprocess

        from conftest import free_port

        from lightning_harness.proxy.locate import proxy_python

        self.port = free_port()
        script = work / "stream_sse.py"
        script.write_text(STREAM_SSE_ADDON)
        mitmdump = str(Path(proxy_python()).parent / "mitmdump")
        self.log = open(work / "mitmdump.log", "ab")
        self.proc = subprocess.Popen(
            [mitmdump, "-q", "--mode", f"reverse:{upstream}", "--listen-host", "127.0.0.1", "--listen-port",
             str(self.port), "--set", f"confdir={work / 'conf'}", "-s", str(script), *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._wait()

    def _wait(self, timeout: float = 60) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mitmdump exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("mitmdump did not start listening")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def measure(target: Target, pid: int, concurrency: int, seconds: float, body: bytes) -> dict:
    """One load point with the CPU the process ``pid`` spent on it."""
    cpu0 = cpu_seconds(pid)
    x = load(target, concurrency, seconds=seconds, body=body)
    x["cpu_ms_per_req"] = 1000 * (cpu_seconds(pid) - cpu0) / max(1, x["requests"])
    return x


def measure_together(sides: list[tuple[Target, int, bytes]], concurrency: int, seconds: float) -> list[dict]:
    """Every side (target, pid, body) loaded at the same time for ``seconds``, each with the CPU its
    process spent: all see the same moment of a shared machine, so load from elsewhere hits them
    alike (each gets less CPU than alone: compare them with each other, not with a run in turns)."""
    async def run() -> list[dict]:
        return await asyncio.gather(*(run_load(t, concurrency, seconds=seconds, body=b) for t, _, b in sides))

    before = [cpu_seconds(pid) for _, pid, _ in sides]
    got = asyncio.run(run())
    for x, (_, pid, _), cpu0 in zip(got, sides, before):
        x["cpu_ms_per_req"] = 1000 * (cpu_seconds(pid) - cpu0) / max(1, x["requests"])
    return got


def plain_comparison(a, proxy_target: Target, proxy_pid: int, plain: PlainMitmproxy, bodies: dict,
                     bare: tuple[Target, int] | None = None) -> list[dict]:
    """The proxy vs plain mitmproxy, alternating (plain, proxy) ``--rounds`` times per case so
    that load from other processes on the machine hits both alike (``--together``: both loaded at
    once each round, which narrows the spread much more); the median round counts.
    ``bare``: a second proxy with token-id injection off (target, pid), for the "SSE, nothing injected"
    row: the same small stream as plain mitmproxy, capture and recording only, no stripping."""
    plain_target = Target(plain.url)
    for body in bodies.values():  # warm up both paths
        load(plain_target, 4, total=100, body=body)
        load(proxy_target, 4, total=100, body=body)
    # (case, concurrency, what plain mitmproxy is sent, what the proxy is sent). "sse_same": plain
    # mitmproxy relays the very upstream stream the proxy gets (the harness's request plus the token
    # ids and logprobs the proxy injects), so the ratio is the cost of our work on equal bytes; "json_same"
    # likewise for a JSON answer.
    cj, cs = a.plain_json_concurrency, a.sse_concurrency
    main = (proxy_target, proxy_pid)
    cases = [("json", cj, "json", "json", main), ("json_same", cj, "json_asked", "json", main),
             ("sse", cs, "sse", "sse", main), ("sse_same", cs, "sse_asked", "sse", main)]
    if bare is not None:
        load(bare[0], 4, total=100, body=bodies["sse"])
        cases.append(("sse_bare", cs, "sse", "sse", bare))
    out = []
    for kind, c, plain_body, proxy_body, (target, pid) in cases:
        rounds = {"plain": [], "proxy": []}
        for _ in range(a.rounds):
            if a.together:
                sides = [(plain_target, plain.pid, bodies[plain_body]), (target, pid, bodies[proxy_body])]
                b, x = measure_together(sides, c, a.seconds)
            else:
                b = measure(plain_target, plain.pid, c, a.seconds, bodies[plain_body])
                x = measure(target, pid, c, a.seconds, bodies[proxy_body])
            rounds["plain"].append(b)
            rounds["proxy"].append(x)
        point = {"case": kind, "concurrency": c}
        for who, xs in rounds.items():
            point[who] = {key: sorted(x[key] for x in xs)[len(xs) // 2]
                          for key in ("rps", "p50_ms", "p99_ms", "ttfb_p50_ms", "cpu_ms_per_req")}
            point[who]["errors"] = sum(x["errors"] for x in xs)
        for key in ("cpu_ms_per_req", "p50_ms"):  # each round's proxy/plain ratio: this machine's noise
            ratios = [x[key] / b[key] for b, x in zip(rounds["plain"], rounds["proxy"]) if b[key]]
            point[f"{key}_ratio_range"] = (min(ratios), max(ratios)) if ratios else None
        out.append(point)
    return out


# -- the benchmark ----------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run: 1.5 s per point, 2,000-request memory run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--seconds", type=float, default=5.0, help="measurement time per point")
    ap.add_argument("--memory-requests", type=int, default=20_000)
    ap.add_argument("--mode", choices=["reverse", "forward"], default="reverse", help="how the load reaches the proxy")
    ap.add_argument("--proxies", type=int, default=2,
                    help="also measure aggregate req/s with this many proxy processes (0/1: skip)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-inject", action="store_true", help="turn token-id injection/stripping off")
    ap.add_argument("--json", dest="json_out", help="also write the figures as JSON here")
    ap.add_argument("--sse-tokens", type=int, default=50, help="chunks per streamed answer (vs plain mitmproxy)")
    ap.add_argument("--sse-concurrency", type=int, default=16)
    ap.add_argument("--plain-json-concurrency", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per case vs plain mitmproxy (median)")
    ap.add_argument("--together", action="store_true",
                    help="vs plain mitmproxy: load both at once each round, not in turns (a noisy machine)")
    ap.add_argument("--no-plain", action="store_true", help="skip the comparison with plain mitmproxy")
    ap.add_argument("--only-plain", action="store_true", help="only the comparison with plain mitmproxy")
    ap.add_argument("--bare", action="store_true",
                    help="also a proxy with injection off vs plain on the same stream (what recording alone costs)")
    a = ap.parse_args()
    if a.quick:
        a.seconds, a.memory_requests = 1.5, 2_000

    from fixtures_proxy import StubServer

    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    body = json.dumps({"model": "gpt-4o", "max_tokens": a.max_tokens,
                       "messages": [{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": "Say something short, please."}]}).encode()
    sse_request = {"model": "gpt-4o", "max_tokens": a.sse_tokens, "stream": True,
                   "messages": [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "Say something short, please."}]}
    sse_body = json.dumps(sse_request).encode()
    sse_asked = json.dumps({**sse_request, "return_token_ids": True, "logprobs": True}).encode()
    json_asked = json.dumps({**json.loads(body), "return_token_ids": True, "logprobs": True}).encode()
    stub = StubServer(work)
    plain: PlainMitmproxy | None = None
    proxies: list[ProxyProcess] = []
    results: dict = {"points": [], "config": {**vars(a), "how": "rounds loading both at once" if a.together
                                               else "alternating rounds"}}
    try:
        def start_proxy(i: int, inject: bool = not a.no_inject) -> ProxyProcess:
            p = ProxyProcess(work / f"traces-{i}", upstreams=[stub.url], route_hosts=["api.openai.com"],
                             confdir=work / "conf",
                             log_path=work / f"proxy-{i}.log", inject_token_ids=inject)
            proxies.append(p.start())
            return p

        p = start_proxy(0)

        def proxy_target(px: ProxyProcess, rid: str) -> Target:
            env = px.env_for(rid)
            if a.mode == "reverse":
                return Target(env["OPENAI_BASE_URL"])
            return Target("http://api.openai.com/v1", proxy=env["HTTP_PROXY"])

        direct = Target(stub.url + "/v1")
        via = proxy_target(p, "bench")
        if not a.no_plain:
            plain = PlainMitmproxy(stub.url, work)
            console.print("[dim]proxy vs plain mitmproxy ...[/dim]")
            bare = None
            if a.bare:
                bp = start_proxy(99, inject=False)  # (its own traces folder, out of the scaling run's way)
                bare = (proxy_target(bp, "bench"), bp.pid)
            results["plain"] = plain_comparison(a, via, p.pid, plain,
                                                {"json": body, "json_asked": json_asked, "sse": sse_body,
                                                 "sse_asked": sse_asked}, bare)
            if a.bare:
                bp.stop()
                proxies.remove(bp)
            plain.stop()
            plain = None
        if a.only_plain:
            a.concurrency, a.memory_requests, a.proxies = [], 0, 0
        load(direct, 4, total=200, body=body)  # warm up both paths
        load(via, 4, total=200, body=body)
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as prog:
            task = prog.add_task("concurrency sweep", total=len(a.concurrency) * 2)
            for c in a.concurrency:
                prog.update(task, description=f"direct  c={c}")
                d = load(direct, c, seconds=a.seconds, body=body)
                prog.advance(task)
                prog.update(task, description=f"proxy   c={c}")
                cpu0, own0 = cpu_seconds(p.pid), time.process_time()
                x = load(via, c, seconds=a.seconds, body=body)
                cpu, own = cpu_seconds(p.pid) - cpu0, time.process_time() - own0
                x["cpu_ms_per_req"] = 1000 * cpu / max(1, x["requests"])
                x["proxy_cpu_util"] = cpu / x["seconds"]
                x["loadgen_cpu_ms_per_req"] = 1000 * own / max(1, x["requests"])
                prog.advance(task)
                results["points"].append({"concurrency": c, "direct": d, "proxy": x})

            # memory over a long run
            if a.memory_requests:
                mem_task = prog.add_task(f"memory run ({a.memory_requests:,} requests, c=16)", total=a.memory_requests)
                p.control.flush()
                rss0 = rss_mib(p.pid)
                captured0 = p.control.state()["spans_captured"]
                cpu0 = cpu_seconds(p.pid)
                m = load(via, 16, total=a.memory_requests, body=body, progress=lambda: prog.advance(mem_task))
                cpu = cpu_seconds(p.pid) - cpu0
                p.control.flush()
                st = p.control.state()
                results["memory"] = {
                    "requests": m["requests"], "errors": m["errors"], "rps": m["rps"],
                    "rss_before_mib": rss0, "rss_after_mib": rss_mib(p.pid),
                    "cpu_ms_per_req": 1000 * cpu / max(1, m["requests"]),
                    "spans_captured": st["spans_captured"] - captured0, "spans_written": st["spans_written"],
                }

            # scaling with more proxy processes
            if a.proxies and a.proxies > 1:
                prog.add_task(f"scaling: {a.proxies} proxy processes", total=None)
                for i in range(1, a.proxies):
                    start_proxy(i)
                c = max(a.concurrency)
                per = max(1, c // a.proxies)

                async def multi():
                    outs = await asyncio.gather(*(run_load(proxy_target(px, f"s{i}"), per, seconds=a.seconds, body=body)
                                                  for i, px in enumerate(proxies)))
                    return outs

                cpu0s = [cpu_seconds(px.pid) for px in proxies]
                outs = asyncio.run(multi())
                cpus = [cpu_seconds(px.pid) - c0 for px, c0 in zip(proxies, cpu0s)]
                results["scaling"] = {
                    "proxies": a.proxies, "concurrency": per * a.proxies,
                    "rps_total": sum(o["rps"] for o in outs),
                    "rps_one_proxy": next(pt["proxy"]["rps"] for pt in results["points"] if pt["concurrency"] == c),
                    "cpu_ms_per_req": 1000 * sum(cpus) / max(1, sum(o["requests"] for o in outs)),
                    "p99_ms": max(o["p99_ms"] for o in outs),
                }
    finally:
        if plain is not None:
            plain.stop()
        for px in proxies:
            px.stop()
        stub.stop()

    report(results, os.cpu_count())
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=2))
    console.print(f"[dim]work dir (traces, logs): {work}[/dim]")
    return 0


def report_plain(out: Console, res: dict) -> None:
    t = Table(title="lightning-proxy vs plain mitmproxy (mitmdump, event streams streamed), same stub, median of "
                    f"{res['config']['rounds']} {res['config']['how']} (ratios: of the medians, then the lowest "
                    "and highest of one round's pair)")
    for col in ("case", "conc", "plain req/s", "proxy req/s", "plain CPU ms/req", "proxy CPU ms/req", "CPU ratio",
                "plain p50", "proxy p50", "p50 ratio", "plain TTFB", "proxy TTFB", "TTFB ratio", "errors"):
        t.add_column(col, justify="right")

    def ratio(pt: dict, key: str) -> str:
        """The ratio of the medians, and the lowest and highest ratio of one round's pair."""
        lo_hi = pt.get(f"{key}_ratio_range")
        spread = f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})" if lo_hi and res["config"]["rounds"] > 1 else ""
        return f"{pt['proxy'][key] / pt['plain'][key]:.2f}{spread}"

    for pt in res["plain"]:
        b, x = pt["plain"], pt["proxy"]
        case = {"sse": f"SSE x{res['config']['sse_tokens']}", "json": "JSON", "json_same": "JSON same bytes",
                "sse_same": f"SSE x{res['config']['sse_tokens']} same bytes",
                "sse_bare": f"SSE x{res['config']['sse_tokens']} nothing injected"}[pt["case"]]
        t.add_row(case, str(pt["concurrency"]), f"{b['rps']:.0f}", f"{x['rps']:.0f}",
                  f"{b['cpu_ms_per_req']:.2f}", f"{x['cpu_ms_per_req']:.2f}",
                  ratio(pt, "cpu_ms_per_req"), f"{b['p50_ms']:.2f}", f"{x['p50_ms']:.2f}", ratio(pt, "p50_ms"),
                  f"{b['ttfb_p50_ms']:.2f}", f"{x['ttfb_p50_ms']:.2f}", f"{x['ttfb_p50_ms'] / b['ttfb_p50_ms']:.2f}",
                  f"{b['errors']}/{x['errors']}")
    out.print(t)
    verdicts = []
    for pt in res["plain"]:
        b, x = pt["plain"], pt["proxy"]
        if pt["case"] == "sse":
            r = x["cpu_ms_per_req"] / b["cpu_ms_per_req"]
            verdicts.append(f"SSE CPU/req <= 1.2x plain: {r:.2f}x -> {'OK' if r <= 1.2 else 'MISSED'}")
        elif pt["case"] == "sse_same":
            r = x["cpu_ms_per_req"] / b["cpu_ms_per_req"]
            verdicts.append(f"(plain relaying the same upstream stream: {r:.2f}x)")
        elif pt["case"] == "sse_bare":
            r = x["cpu_ms_per_req"] / b["cpu_ms_per_req"]
            verdicts.append(f"(a proxy injecting nothing, on the same stream as plain: {r:.2f}x)")
        elif pt["case"] == "json_same":
            r = x["p50_ms"] / b["p50_ms"]
            verdicts.append(f"(plain relaying the same upstream answer: p50 {r:.2f}x)")
        else:
            r = x["p50_ms"] / b["p50_ms"]
            verdicts.append(f"JSON c={pt['concurrency']} p50 <= plain: {r:.2f}x -> {'OK' if r <= 1.0 else 'MISSED'}")
    out.print("targets vs plain mitmproxy: " + "; ".join(verdicts))


def report(res: dict, ncpu: int | None) -> None:
    out = Console(width=200)
    if res.get("plain"):
        report_plain(out, res)
    if not res["points"]:
        return
    t = Table(title=f"lightning-proxy vs direct (capture + rewriting on, {res['config']['mode']} mode, {ncpu} CPUs)")
    for col in ("conc", "direct req/s", "proxy req/s", "ratio", "direct p50", "proxy p50", "direct p99", "proxy p99",
                "p50 +ms", "proxy CPU ms/req", "proxy CPU util", "1-core capacity", "loadgen ms/req"):
        t.add_column(col, justify="right")
    for pt in res["points"]:
        d, x = pt["direct"], pt["proxy"]
        t.add_row(str(pt["concurrency"]), f"{d['rps']:.0f}", f"{x['rps']:.0f}", f"{x['rps'] / d['rps']:.2f}",
                  f"{d['p50_ms']:.2f}", f"{x['p50_ms']:.2f}", f"{d['p99_ms']:.2f}", f"{x['p99_ms']:.2f}",
                  f"{x['p50_ms'] - d['p50_ms']:.2f}", f"{x['cpu_ms_per_req']:.2f}", f"{x['proxy_cpu_util']:.0%}",
                  f"{1000 / x['cpu_ms_per_req']:.0f}", f"{x['loadgen_cpu_ms_per_req']:.2f}")
    out.print(t)
    m = res.get("memory")
    if m:
        out.print(
            f"memory: {m['requests']:,} requests ({m['errors']} errors) at {m['rps']:.0f} req/s, "
            f"RSS {m['rss_before_mib']:.1f} -> {m['rss_after_mib']:.1f} MiB "
            f"({m['rss_after_mib'] - m['rss_before_mib']:+.1f} MiB), CPU {m['cpu_ms_per_req']:.2f} ms/req, "
            f"spans captured {m['spans_captured']:,}"
        )
    s = res.get("scaling")
    if s:
        out.print(
            f"scaling: {s['proxies']} proxy processes at total concurrency {s['concurrency']}: "
            f"{s['rps_total']:.0f} req/s vs {s['rps_one_proxy']:.0f} with one "
            f"(x{s['rps_total'] / s['rps_one_proxy']:.2f}), CPU {s['cpu_ms_per_req']:.2f} ms/req, "
            f"p99 {s['p99_ms']:.1f} ms"
        )
    out.print("1-core capacity = 1000 / proxy CPU ms per request: the req/s one proxy process sustains when it "
              "has a whole core (proxy req/s falls below it when other processes share the CPUs; see CPU util).")
    try:
        out.print(f"load average during the run: {os.getloadavg()[0]:.1f} on {ncpu} CPUs")
    except OSError:
        pass
    worst = max(pt["proxy"]["cpu_ms_per_req"] for pt in res["points"])
    best_rps = max(pt["proxy"]["rps"] for pt in res["points"])
    out.print(f"targets: CPU/req <= 3.5 ms at every concurrency: "
              f"{worst:.2f} ms -> {'OK' if worst <= 3.5 else 'MISSED'}; "
              f"one process >= 300 captured req/s: {best_rps:.0f} -> {'OK' if best_rps >= 300 else 'MISSED'}"
              + (f"; RSS growth < 20 MiB: {m['rss_after_mib'] - m['rss_before_mib']:+.1f} MiB -> "
                 f"{'OK' if m['rss_after_mib'] - m['rss_before_mib'] < 20 else 'MISSED'}" if m else ""))


if __name__ == "__main__":
    sys.exit(main())
