#!/usr/bin/env python
"""Soak the capture proxy with hostile input mixed into normal traffic, and measure what it costs.

One run, one stub upstream, real proxy processes:
1. soak: ``--requests`` calls (default 20,000, concurrency 16) of which ``--hostile`` (1%) are
   hostile: bodies that are not UTF-8, gzip bombs (200 KiB -> 200 MiB), bodies over max_body_size,
   streams cut short, clients hanging up mid-body, bad credentials, huge attempt numbers, CR/LF in
   rollout ids. Every call the proxy did not refuse at authentication must have exactly one span on
   disk: it prints spans expected vs on disk (lost must be 0), error kinds, RSS before/after;
2. memory: RSS peak (VmHWM, reset through /proc/PID/clear_refs) under one gzip bomb and under
   50 MB bodies (refused, 413) and 20 MB bodies (accepted), and RSS a few seconds after;
3. SSE: relay time of one 1/2/4/8 MB event through the proxy (injection + stripping on, so every
   event is parsed and rewritten) with the ratio to 1 MB (linear: ~2/4/8), the same straight to the
   stub, and the worst latency of small calls made meanwhile (other clients stay responsive);
4. ``--signals N``: N runs each of SIGTERM and SIGKILL while calls are in flight; a call whose
   answer reached the client and has no span is lost (SIGTERM: must be 0; SIGKILL: at most the
   calls answered in the last flush interval).

    .venv/bin/python scripts/bench_hostile.py                          # full soak (~5-10 min on 2 busy cores)
    .venv/bin/python scripts/bench_hostile.py --requests 2000 --signals 3   # small run
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_proxy import rss_mib  # noqa: E402

from lightning_harness.proxy.client import ProxyProcess  # noqa: E402
from lightning_harness.proxy.credentials import InvalidId, attempt_credential  # noqa: E402
from lightning_harness.schemas import read_table  # noqa: E402

MiB = 1 << 20
BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Say something short."}]}
HOSTILE = ["bad_utf8", "gzip_bomb", "oversized", "truncated_stream", "disconnect_mid_body",
           "bad_credentials", "huge_attempt", "crlf_rollout"]


def hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_hwm(pid: int) -> None:
    """Peak RSS starts again from the current RSS (Linux: ``5`` to clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


# -- a tiny HTTP/1.1 client: one connection per call, so a call can misbehave on its own ------------
class Call:
    def __init__(self, base: str, rollout: str, token: str, *, forged: bool = False) -> None:
        """``rollout`` is ``id`` or ``id~attempt``; the path carries that attempt's own credential
        (derived from the proxy token, as the launcher does), or ``token`` as is when ``forged``."""
        u = urllib.parse.urlsplit(base)
        self.host, self.port = u.hostname, u.port
        rid, _, att = rollout.partition("~")
        try:
            secret = token if forged or not token else attempt_credential(token, rid, int(att) if att.isdigit() else 0)
        except InvalidId:  # an id the proxy must refuse by its rules, whatever the credential
            secret = "no-credential-for-an-invalid-id"
        self.path = f"/lh/{rollout}/{secret}/v1/chat/completions"

    def bytes(self, body: bytes, headers: dict | None = None, length: int | None = None) -> bytes:
        lines = [f"POST {self.path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Content-Type: application/json",
                 "Connection: close", f"Content-Length: {len(body) if length is None else length}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def send(self, body: bytes, headers: dict | None = None, hang_up_after: int | None = None):
        """(status, body) of the answer; ``hang_up_after``: send that many body bytes and close."""
        r, w = await asyncio.open_connection(self.host, self.port)
        try:
            if hang_up_after is not None:
                w.write(self.bytes(body[:hang_up_after], headers, length=len(body)))
                await w.drain()
                await asyncio.sleep(0.2)
                return None, b""
            w.write(self.bytes(body, headers))
            await w.drain()
            return await read_answer(r)
        finally:
            w.close()


async def read_answer(r: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    low = head.lower()
    if b"transfer-encoding: chunked" in low:
        parts = []
        while True:
            size = int((await r.readline()).split(b";")[0].strip(), 16)
            parts.append(await r.readexactly(size + 2))
            if size == 0:
                return status, b"".join(parts)
    i = low.find(b"content-length:")
    n = int(low[i + 15 : low.find(b"\r\n", i)].strip()) if i >= 0 else 0
    return status, await r.readexactly(n)


def refused_at_auth(status: int | None, body: bytes) -> bool:
    """Answers that mean the proxy did not attribute the call: it has no span, by design."""
    return status in (400, 401, 403, 407) and b"lightning-proxy" in body


# -- 1. soak ------------------------------------------------------------------------------------------
def hostile_call(kind: str, base: str, token: str, i: int, max_body: int) -> tuple:
    """(Call, body, headers, hang_up_after) for one hostile request."""
    plain = json.dumps(BODY).encode()
    rid = f"soak-{kind}-{i}"
    if kind == "bad_utf8":
        return Call(base, rid, token), plain.replace(b"short", b"sh\xff\xfeort"), {}, None
    if kind == "gzip_bomb":
        return Call(base, rid, token), BOMB, {"Content-Encoding": "gzip"}, None
    if kind == "oversized":
        big = json.dumps({**BODY, "messages": [{"role": "user", "content": "x" * (max_body + MiB)}]}).encode()
        return Call(base, rid, token), big, {}, None
    if kind == "truncated_stream":
        return Call(base, rid, token), json.dumps({**BODY, "stream": True}).encode(), {"X-Stub-Truncate": "1"}, None
    if kind == "disconnect_mid_body":
        return Call(base, rid, token), plain + b" " * 4000, {}, 100
    if kind == "bad_credentials":
        return Call(base, rid, "wrong-token", forged=True), plain, {}, None
    if kind == "huge_attempt":
        return Call(base, f"{rid}~{10 ** 30}", token), plain, {}, None
    return Call(base, f"soak%0D%0A{kind}%0D%0AX-Injected:%20{i}", token), plain, {}, None  # crlf_rollout


BOMB = gzip.compress(b" " * (200 * MiB), compresslevel=9)


async def soak(p: ProxyProcess, n: int, hostile_share: float, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    base, token = p.reverse_url, p.token
    plan = ["normal"] * n
    for k in range(max(1, int(n * hostile_share))):
        plan[rng.randrange(n)] = HOSTILE[k % len(HOSTILE)]
    plain = json.dumps(BODY).encode()
    out = Counter()
    statuses: dict[str, Counter] = {}
    next_i = 0
    max_body = 32 * MiB  # the proxy's default max_body_size

    async def one(i: int) -> None:
        kind = plan[i]
        if kind == "normal":
            call, body, headers, hang = Call(base, f"soak-normal-{i % 500}", token), plain, {}, None
        else:
            call, body, headers, hang = hostile_call(kind, base, token, i, max_body)
        try:
            status, answer = await call.send(body, headers, hang)
        except (OSError, asyncio.IncompleteReadError) as exc:
            statuses.setdefault(kind, Counter())[type(exc).__name__] += 1
            out["client_errors"] += 1
            out["expected"] += 1  # the proxy saw the call; it owes a span whatever the client saw
            return
        statuses.setdefault(kind, Counter())[status] += 1
        out["expected"] += 0 if refused_at_auth(status, answer) else 1

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i, next_i = next_i, next_i + 1
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    out["seconds"] = time.perf_counter() - t0
    out["hostile"] = sum(1 for k in plan if k != "normal")
    out["requests"] = n
    return {"counts": dict(out), "statuses": {k: dict(v) for k, v in statuses.items()}}


def run_soak(a, work: Path, stub) -> dict:
    p = ProxyProcess(work / "traces-soak", upstreams=[stub.url], confdir=work / "conf",
                     log_path=work / "proxy-soak.log").start()
    try:
        asyncio.run(soak_warmup(p))
        p.control.flush()
        rss0 = rss_mib(p.pid)
        res = asyncio.run(soak(p, a.requests, a.hostile, a.concurrency, a.seed))
        time.sleep(2.5)  # let the memory trimmer run after the last large body
        res["rss_before_mib"], res["rss_after_mib"] = rss0, rss_mib(p.pid)
        res["state"] = p.control.state()
    finally:
        res_rc = p.stop()
    spans = read_table(p.traces_dir, "spans").to_pylist()
    res["stop_rc"] = res_rc
    res["on_disk"] = len(spans) - WARMUP
    res["error_kinds"] = dict(Counter(s["error_kind"] or "ok" for s in spans))
    res["salvaged"] = sum(1 for s in spans if s["salvaged"])
    return res


WARMUP = 50


async def soak_warmup(p: ProxyProcess) -> None:
    call = Call(p.reverse_url, "warmup", p.token)
    for _ in range(WARMUP):
        await call.send(json.dumps(BODY).encode())


# -- 2. memory ------------------------------------------------------------------------------------------
async def memory(p: ProxyProcess) -> dict:
    out = {}
    call = Call(p.reverse_url, "mem", p.token)
    base = rss_mib(p.pid)
    reset_hwm(p.pid)
    status, _ = await call.send(BOMB, {"Content-Encoding": "gzip"})
    out["bomb"] = {"status": status, "rss_before": base, "peak": hwm_mib(p.pid)}
    for label, size, n in (("50MB", 50_000_000, 3), ("20MB", 20_000_000, 3)):
        body = json.dumps({**BODY, "messages": [{"role": "user", "content": "x" * size}]}).encode()
        before = rss_mib(p.pid)
        reset_hwm(p.pid)
        got = [(await call.send(body))[0] for _ in range(n)]
        del body
        peak = hwm_mib(p.pid)
        await asyncio.sleep(3.0)  # the trimmer runs once a second while large bodies were seen
        out[label] = {"status": got, "rss_before": before, "peak": peak, "rss_after": rss_mib(p.pid)}
    return out


# -- 3. SSE linearity -------------------------------------------------------------------------------------
async def timed_stream(base: str, rollout: str, token: str | None, nbytes: int) -> float:
    body = json.dumps({**BODY, "stream": True}).encode()
    if token is None:  # straight to the stub
        u = urllib.parse.urlsplit(base)
        call = Call(base, "", "")
        call.host, call.port, call.path = u.hostname, u.port, "/v1/chat/completions"
    else:
        call = Call(base, rollout, token)
    t0 = time.perf_counter()
    status, answer = await call.send(body, {"X-Stub-Event-Bytes": str(nbytes)})
    dt = time.perf_counter() - t0
    assert status == 200 and len(answer) > nbytes, (status, len(answer))
    return dt


async def small_calls_meanwhile(base: str, token: str, task: asyncio.Task) -> list[float]:
    lat = []
    call = Call(base, "bystander", token)
    while not task.done():
        t0 = time.perf_counter()
        await call.send(json.dumps(BODY).encode())
        lat.append(time.perf_counter() - t0)
    return lat


async def sse(p: ProxyProcess, stub_url: str, sizes: list[int], reps: int) -> dict:
    out = {"proxy": {}, "direct": {}}
    await timed_stream(p.reverse_url, "sse-warm", p.token, MiB)
    for mb in sizes:
        out["proxy"][mb] = min([await timed_stream(p.reverse_url, f"sse-{mb}", p.token, mb * MiB) for _ in range(reps)])
        out["direct"][mb] = min([await timed_stream(stub_url, "", None, mb * MiB) for _ in range(reps)])
    big = asyncio.ensure_future(timed_stream(p.reverse_url, "sse-big", p.token, max(sizes) * MiB))
    lat = await small_calls_meanwhile(p.reverse_url, p.token, big)
    out["bystander_max_ms"] = 1000 * max(lat) if lat else float("nan")
    out["bystander_calls"] = len(lat)
    return out


def run_memory_and_sse(a, work: Path, stub) -> dict:
    p = ProxyProcess(work / "traces-mem", upstreams=[stub.url], confdir=work / "conf",
                     log_path=work / "proxy-mem.log").start()
    try:
        asyncio.run(soak_warmup(p))
        mem = asyncio.run(memory(p))
        s = asyncio.run(sse(p, stub.url, a.sse_sizes, a.sse_reps))
    finally:
        p.stop()
    return {"memory": mem, "sse": s}


# -- 4. signals ------------------------------------------------------------------------------------------
async def load_until_signal(p: ProxyProcess, sig: int, after: float, tag: str) -> tuple[dict, float]:
    """Calls (1 per rollout) until the proxy dies; returns {rollout: answered_at} and the kill time."""
    answered: dict[str, float] = {}
    body = json.dumps(BODY).encode()
    stop = False
    counter = iter(range(10 ** 9))

    async def worker() -> None:
        while not stop:
            rid = f"{tag}-{next(counter)}"
            delay = random.choice(["0", "0", "0", "0.5", "3"])  # some calls are still running at the signal
            try:
                status, answer = await Call(p.reverse_url, rid, p.token).send(body, {"X-Stub-Delay": delay})
            except (OSError, asyncio.IncompleteReadError):
                await asyncio.sleep(0.05)
                continue
            if not refused_at_auth(status, answer):
                answered[rid] = time.time()

    tasks = [asyncio.ensure_future(worker()) for _ in range(8)]
    await asyncio.sleep(after)
    killed_at = time.time()
    os.killpg(p.proc.pid, sig)
    await asyncio.get_running_loop().run_in_executor(None, p.proc.wait)
    stop = True
    await asyncio.sleep(0.1)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return answered, killed_at


def run_signals(a, work: Path, stub) -> dict:
    out = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        runs = []
        for k in range(a.signals):
            d = work / f"sig-{sig.name}-{k}"
            p = ProxyProcess(d / "traces", upstreams=[stub.url], confdir=work / "conf", log_path=d / "proxy.log",
                             extra_args=["--shutdown-grace", "1"]).start()
            answered, killed_at = asyncio.run(load_until_signal(p, sig, 1.0 + random.random(), f"{sig.name}-{k}"))
            try:
                on_disk = {r["rollout_id"] for r in read_table(p.traces_dir, "spans").to_pylist()}
            except Exception:  # nothing written yet (SIGKILL inside the first flush interval)
                on_disk = set()
            lost = [rid for rid in answered if rid not in on_disk]
            ages = [killed_at - answered[rid] for rid in lost]  # how long before the signal they were answered
            runs.append({"answered": len(answered), "on_disk": len(on_disk), "lost": len(lost),
                         "oldest_lost_s": max(ages) if ages else 0.0})
        out[sig.name] = runs
    return out


# -- report ----------------------------------------------------------------------------------------------
def report(res: dict) -> None:
    s = res.get("soak")
    if s:
        c = s["counts"]
        lost = c["expected"] - s["on_disk"]
        print(f"soak: {c['requests']:,} calls ({c['hostile']} hostile) in {c['seconds']:.1f} s "
              f"({c['requests'] / c['seconds']:.0f} calls/s), proxy exit code {s['stop_rc']}")
        print(f"  spans expected {c['expected']:,}, on disk {s['on_disk']:,}, "
              f"lost {lost} -> {'OK' if lost == 0 else 'LOST SPANS'}")
        print(f"  error kinds on disk: {s['error_kinds']}; salvaged {s['salvaged']}; "
              f"rejected {s['state'].get('rejected')}")
        for kind, st in sorted(s["statuses"].items()):
            print(f"    {kind:22s} answers {st}")
        print(f"  RSS before {s['rss_before_mib']:.1f} MiB, after {s['rss_after_mib']:.1f} MiB "
              f"({s['rss_after_mib'] - s['rss_before_mib']:+.1f} MiB)")
    m = res.get("memory")
    if m:
        b = m["bomb"]
        print(f"gzip bomb ({len(BOMB) // 1024} KiB -> 200 MiB): HTTP {b['status']}, RSS {b['rss_before']:.1f} MiB, "
              f"peak {b['peak']:.1f} MiB ({b['peak'] - b['rss_before']:+.1f})")
        for label in ("50MB", "20MB"):
            x = m[label]
            print(f"{label} bodies x{len(x['status'])}: HTTP {x['status']}, "
                  f"RSS {x['rss_before']:.1f} -> peak {x['peak']:.1f} ({x['peak'] - x['rss_before']:+.1f}) "
                  f"-> {x['rss_after']:.1f} MiB 3 s later ({x['rss_after'] - x['rss_before']:+.1f})")
    e = res.get("sse")
    if e:
        base_p, base_d = e["proxy"][min(e["proxy"])], e["direct"][min(e["direct"])]
        for mb in sorted(e["proxy"]):
            print(f"SSE one {mb} MB event: "
                  f"proxy {e['proxy'][mb]:.3f} s (x{e['proxy'][mb] / base_p:.2f} of {min(e['proxy'])} MB), "
                  f"direct {e['direct'][mb]:.3f} s (x{e['direct'][mb] / base_d:.2f})")
        print(f"  small calls while a {max(e['proxy'])} MB event streamed: {e['bystander_calls']}, "
              f"worst {e['bystander_max_ms']:.0f} ms")
    g = res.get("signals")
    if g:
        for name, runs in g.items():
            lost = [r["lost"] for r in runs]
            oldest = max(r["oldest_lost_s"] for r in runs)
            print(f"{name}: {len(runs)} runs, calls answered {[r['answered'] for r in runs]}, lost {lost}; "
                  f"oldest lost answer {oldest:.2f} s before the signal (flush_seconds 1, checked every 0.25 s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000, help="soak size (0: skip the soak)")
    ap.add_argument("--hostile", type=float, default=0.01, help="share of hostile calls in the soak")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sse-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="MB per single SSE event")
    ap.add_argument("--sse-reps", type=int, default=3, help="best of this many per size")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory and SSE measurements")
    ap.add_argument("--signals", type=int, default=0, help="runs each of SIGTERM and SIGKILL under load")
    ap.add_argument("--json", dest="json_out", help="also write the figures as JSON here")
    a = ap.parse_args()

    from fixtures_proxy import StubServer

    work = Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    stub = StubServer(work)
    res: dict = {"config": vars(a)}
    try:
        if a.requests:
            res["soak"] = run_soak(a, work, stub)
        if not a.no_memory:
            res.update(run_memory_and_sse(a, work, stub))
        if a.signals:
            res["signals"] = run_signals(a, work, stub)
    finally:
        stub.stop()
    report(res)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=2, default=str))
    print(f"work dir (traces, logs): {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
