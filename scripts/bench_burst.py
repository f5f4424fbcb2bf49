#!/usr/bin/env python
"""Many clients connecting at once: the proxy against plain mitmproxy, in one run.

Harnesses that start together connect together. Each size N in ``--sizes`` is measured twice on
each of the proxy's reverse listener and a plain ``mitmdump`` in reverse mode (asyncio's accept
queue of 100, as the proxy had before it raised its own):
- connections: N opened at once (non-blocking), seconds until each handshake completed;
- requests: N opened at once, each sending one GET as soon as it connects; seconds until its
  answer's first byte (both answer it themselves: the proxy 401, no credentials; mitmdump 502, its
  upstream is down), so this is the proxy's own pace, no engine involved.
A handshake dropped at a full queue is retried by the client's kernel after 1 s, then 3 s, 7 s...:
the `>1 s` column counts those. CPU: the process's, per client, closing included.

Then what a new connection costs a call through the forward proxy (CONNECT, TLS intercepted, one
chat call to a stub engine): ``--calls`` calls each on a new connection vs as many on one kept
connection (the baseline, same run), the proxy's CPU a call.

    .venv/bin/python scripts/bench_burst.py                    # 1000 and 3000 at once, 300 calls (~2 min)
    .venv/bin/python scripts/bench_burst.py --sizes 500 2000 --calls 0
"""

from __future__ import annotations

import argparse
import errno
import resource
import selectors
import socket
import ssl
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_proxy import PlainMitmproxy, cpu_seconds  # noqa: E402
from fixtures_proxy import StubServer  # noqa: E402

from lightning_harness.proxy.client import ProxyProcess  # noqa: E402

REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: bench\r\n\r\n"
DEAD_UPSTREAM = "http://127.0.0.1:9"  # plain mitmproxy's: nothing listens (the burst's requests dial no engine)


def at_once(port: int, n: int, request: bytes | None, timeout: float = 120) -> list[float]:
    """Open ``n`` connections to ``port`` at once; seconds each took to connect, or with ``request``
    to get the first byte of its answer. Sorted; a connection that never got there is left out."""
    sel, started, took = selectors.DefaultSelector(), {}, []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        if s.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            raise OSError(f"connect to {port} failed")
        started[s] = time.monotonic()
        sel.register(s, selectors.EVENT_WRITE)
    deadline = time.monotonic() + timeout
    while started and time.monotonic() < deadline:
        for key, events in sel.select(0.05):
            s = key.fileobj
            if events & selectors.EVENT_WRITE and request is not None:
                s.send(request)
                sel.modify(s, selectors.EVENT_READ)
                continue
            sel.unregister(s)
            took.append(time.monotonic() - started.pop(s))
            s.close()
    for s in started:
        s.close()
    return sorted(took)


def row(what: str, n: int, took: list[float], cpu_s: float) -> str:
    def ms(q: float) -> str:
        return f"{1000 * took[min(len(took) - 1, int(q * len(took)))]:8.0f}" if took else "       -"

    return (f"| {what:<30} | {n:>5} | {len(took):>5} | {ms(0.5)} | {ms(0.9)} | {ms(1.0)} | "
            f"{sum(t >= 1 for t in took):>5} | {1000 * cpu_s / n:6.2f} |")


def forward_calls(proxy: ProxyProcess, n: int) -> None:
    """``n`` chat calls through the forward proxy on new connections, then ``n`` on one; CPU a call."""
    import httpx

    env = proxy.env_for("bench")
    tls = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    def client():
        return httpx.Client(proxy=env["HTTPS_PROXY"], verify=tls, trust_env=False, timeout=30)

    def call(c) -> None:
        assert c.post("https://api.openai.com/v1/chat/completions", json=body).status_code == 200

    print("\n| chat calls through the forward proxy (TLS intercepted) | calls | proxy CPU ms a call | wall ms a call |")
    print("|---|---|---|---|")
    cpu_kept = None
    for how in ("one kept connection", "a new connection each", "one kept connection", "a new connection each"):
        cpu0, t0 = cpu_seconds(proxy.pid), time.monotonic()
        if how == "one kept connection":
            with client() as c:
                for _ in range(n):
                    call(c)
        else:
            for _ in range(n):
                with client() as c:
                    call(c)
        wall = time.monotonic() - t0
        time.sleep(1.5)  # (the span writer's flush lands in this round's CPU)
        cpu = cpu_seconds(proxy.pid) - cpu0
        cpu_kept = cpu if how == "one kept connection" else cpu_kept
        ratio = f" ({cpu / cpu_kept:.2f}x kept)" if how != "one kept connection" else ""
        print(f"| {how} | {n} | {1000 * cpu / n:.2f}{ratio} | {1000 * wall / n:.1f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 3000], help="clients at once")
    ap.add_argument("--calls", type=int, default=300, help="forward-proxy calls a round (0: skip)")
    a = ap.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # (each client is a descriptor here)
    work = Path(tempfile.mkdtemp(prefix="bench-burst-"))
    stub = StubServer(work)
    proxy = ProxyProcess(work / "traces", upstreams=[stub.url], route_hosts=["api.openai.com"],
                         confdir=work / "conf", log_path=work / "proxy.log").start()
    plain = PlainMitmproxy(DEAD_UPSTREAM, work, ("--set", "connection_strategy=lazy"))  # (as the proxy: no dial
    # before a request; mitmproxy's default dials the upstream at each connection)
    print("| clients at once | N | done | p50 ms | p90 ms | slowest ms | >1 s | CPU ms a client |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for n in a.sizes:
            for kind, request in (("connections", None), ("requests", REQUEST)):
                for name, port, pid in (("lightning-proxy", proxy.config.reverse_port, proxy.pid),
                                        ("plain mitmproxy", plain.port, plain.pid)):
                    cpu0 = cpu_seconds(pid)
                    took = at_once(port, n, request)
                    time.sleep(2)  # (the closed connections drain before the next round, counted in its CPU)
                    print(row(f"{kind}, {name}", n, took, cpu_seconds(pid) - cpu0), flush=True)
        if a.calls:
            forward_calls(proxy, a.calls)
    finally:
        proxy.stop()
        plain.stop()
        stub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
