"""Run mitmproxy embedded with our addons: forward and reverse listeners in one process.

Why embedded (not ``mitmdump -s``): one command with our own flags/YAML, a CA in a chosen
``confdir``, the CA bundle written before the listeners answer, and SIGTERM wired to a clean
shutdown (:class:`GracefulStop`) that lets calls in flight finish for ``shutdown_grace`` seconds,
records the rest as ``shutdown`` error spans and flushes every buffered span and reward.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import signal
import ssl
import sys
import time
from pathlib import Path

# Parquet writes allocate through glibc unless the user chose otherwise. Arrow's default pool
# (mimalloc) kept ~120 MiB after a few 20 MB spans, which MemoryTrim cannot return; with the system
# pool RSS is back within a few MiB of its baseline (scripts/bench_hostile.py). Arrow reads this
# when pyarrow is first imported, which is just below (state -> schemas).
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

from .client import BUNDLE_NAME  # noqa: E402
from .config import ProxyConfig  # noqa: E402
from .state import ProxyState  # noqa: E402

log = logging.getLogger("lightning.proxy")


def system_ca_file() -> str | None:
    """The system CA bundle (so a harness trusting our bundle still reaches real HTTPS sites)."""
    for cand in (ssl.get_default_verify_paths().cafile, "/etc/ssl/certs/ca-certificates.crt",
                 "/etc/pki/tls/certs/ca-bundle.crt"):
        if cand and os.path.exists(cand):
            return cand
    try:
        import certifi

        return certifi.where()
    except ImportError:
        return None


def ensure_ca(confdir: Path) -> None:
    """Create mitmproxy's CA in ``confdir`` now (mitmproxy would do it lazily, after listening)."""
    from mitmproxy import certs
    from mitmproxy.options import CONF_BASENAME

    certs.CertStore.from_store(str(confdir), CONF_BASENAME, 2048)


def write_ca_bundle(confdir: Path) -> Path:
    """``confdir/lightning-ca-bundle.pem`` = system CAs + the proxy CA, written atomically."""
    ensure_ca(confdir)
    ca = confdir / "mitmproxy-ca-cert.pem"
    if not ca.exists():
        raise RuntimeError(f"mitmproxy did not create its CA in {confdir}")
    parts = []
    sys_ca = system_ca_file()
    if sys_ca:
        parts.append(Path(sys_ca).read_text())
    parts.append(ca.read_text())
    bundle = confdir / BUNDLE_NAME
    text = "\n".join(p.rstrip("\n") + "\n" for p in parts)
    if not bundle.exists() or bundle.read_text() != text:
        tmp = confdir / f".{BUNDLE_NAME}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, bundle)
    return bundle


def reverse_spec(config: ProxyConfig) -> str:
    """mitmproxy needs one reverse target; routing picks the real one per request."""
    from .config import parse_upstream

    target = config.upstreams[0] if config.upstreams else None
    if target is None and config.reverse_target:
        target = parse_upstream(config.reverse_target)
    if target is not None:
        return f"{target.scheme}://{target.host}:{target.port}"
    return "http://127.0.0.1:9"  # never contacted: routing answers 502 "no upstream configured"


class LinesPerSite(logging.Filter):
    """At most ``burst`` log lines from one call site at once, then ``per_second``; the next line let
    through says how many were left out.

    Why: a harness (hostile: the policy writes its commands) decides how often the proxy refuses,
    cuts or records an error, and each of those logs a line. Refused calls from one client as fast
    as the proxy answered them (2,000 in 4.7 s) wrote 312 KB of log, ~65 KB a second or ~5.6 GB a
    day, to a file nothing trims. What each line reports is counted anyway (the control API's
    state, the error spans). A call site (logger, level, file, line) is the key, not the message:
    a set that cannot grow."""

    def __init__(self, burst: int = 100, per_second: float = 1.0) -> None:
        super().__init__()
        self.burst, self.per_second = burst, per_second
        self.sites: dict[tuple, tuple[float, float, int]] = {}  # site -> (lines allowed now, when, left out)

    def filter(self, record: logging.LogRecord) -> bool:
        site = (record.name, record.levelno, record.pathname, record.lineno)
        now = time.monotonic()
        allowed, when, left_out = self.sites.get(site, (self.burst, now, 0))
        allowed = min(self.burst, allowed + (now - when) * self.per_second)
        if allowed < 1:
            self.sites[site] = (allowed, now, left_out + 1)
            return False
        if left_out:
            try:
                text = record.getMessage()
            except Exception:  # (a broken call: the formatter reports it as ever)
                text = str(record.msg)
            record.msg, record.args = f"{text} [{left_out} more lines from here not logged]", None
        self.sites[site] = (allowed - 1, now, 0)
        return True

    def left_out(self) -> dict[str, int]:
        """Lines left out and not yet reported, by call site (``file:line``): said once at shutdown."""
        return {f"{Path(site[2]).name}:{site[3]}": n for site, (_, _, n) in self.sites.items() if n}


LINES = LinesPerSite()


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(LINES)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("lightning.proxy").setLevel(logging.INFO)


def make_master(opts, lean: bool = True):
    """mitmproxy's master with our addons' prerequisites.

    ``lean``: only the built-in addons a capture proxy needs (core, proxy server, next layer, TLS,
    h2c guard, error check). mitmproxy calls every hook on every addon; DumpMaster's ~35 defaults
    (playback, map-local, anticache, ...) cost CPU on every request without doing anything here.
    ``lean=False`` is the stock DumpMaster.

    Lean also trims two costs of mitmproxy's own on every call (:func:`_trim_mitmproxy`).
    """
    if not lean:
        from mitmproxy.tools.dump import DumpMaster

        return DumpMaster(opts, with_termlog=False, with_dumper=False)
    from mitmproxy import master
    from mitmproxy.addons import core, disable_h2c, errorcheck, next_layer, proxyserver, tlsconfig

    _trim_mitmproxy()
    m = master.Master(opts, with_termlog=False)
    m.addons.add(
        core.Core(), disable_h2c.DisableH2C(), proxyserver.Proxyserver(), next_layer.NextLayer(),
        tlsconfig.TlsConfig(), errorcheck.ErrorCheck(),
    )
    return m


def _trim_mitmproxy() -> None:
    """Two costs of mitmproxy 11.0.2's own (the version pyproject.toml pins), paid on every call,
    that a capture proxy does not need (measured with py-spy, ``scripts/profile_proxy.py``: 0.16
    and 0.17 ms of a streamed call's 4.4 ms in the proxy, against 0.11 and 0.09 ms of plain
    mitmproxy's 2.9; tests/test_proxy_units.py checks both, and fails if the internals move):

    - The debug-only type check of each request and response it builds (``MessageData.__post_init__``
      exists only ``if __debug__``: gone under ``python -O``). It formats a ``TypeError`` message for
      every field and raises and catches about a dozen a call (one per member of each optional
      type it tries), whose tracebacks then wait for the collector; mitmproxy's parsers type the
      fields themselves.
    - Each chunk of a response body sent to an HTTP/1 client looked up ``Transfer-Encoding`` in the
      response's headers again (a scan of every header, lower-casing each name) to frame it: 52
      times a 50-token answer. The framing is fixed by the head already sent, so it is looked up
      once, when the head goes out, and the chunks are framed as that head said.
    """
    from mitmproxy import http
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers.http import ResponseData, ResponseHeaders
    from mitmproxy.proxy.layers.http._http1 import Http1Server

    http.MessageData.__post_init__ = _unchecked  # (the dataclasses' __init__ still call it)
    send = Http1Server.send
    if getattr(send, "framed_once", False):
        return

    def framed_send(self, event):
        kind = type(event)
        if kind is ResponseData and event.stream_id == self.stream_id and (chunked := self.__dict__.get(_CHUNKED)) \
                is not None:
            raw = b"%x\r\n%s\r\n" % (len(event.data), event.data) if chunked else event.data
            if raw:
                yield commands.SendData(self.conn, raw)
            return
        if kind is ResponseHeaders:
            self.__dict__[_CHUNKED] = "chunked" in event.response.headers.get("transfer-encoding", "").lower()
        elif kind is not ResponseData:  # the answer ended: data with no head goes to mitmproxy's asserts
            self.__dict__.pop(_CHUNKED, None)
        yield from send(self, event)

    framed_send.framed_once = True
    Http1Server.send = framed_send


_CHUNKED = "_lightning_chunked"  # (Http1Server: the head sent last asked for chunked framing)


def _unchecked(self) -> None:
    """What ``MessageData.__post_init__`` is under ``python -O`` (see _trim_mitmproxy)."""


class GracefulStop:
    """SIGTERM/SIGINT: close the door to new model calls (503, limits addon), wait up to
    ``grace`` seconds for the calls in flight, give the rest a ``shutdown`` error span, then stop
    mitmproxy (``state.close()`` flushes). A second signal cuts the wait short. So SIGTERM loses no
    call: each one has its normal span or a ``shutdown`` one."""

    def __init__(self, master, capture, limits, grace: float) -> None:
        self.master, self.capture, self.limits, self.grace = master, capture, limits, grace
        self.task: asyncio.Task | None = None
        self.hurry = asyncio.Event()

    def __call__(self) -> None:
        if self.task is not None:
            self.hurry.set()
            return
        self.task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        self.limits.draining = True
        t0 = time.monotonic()
        deadline = t0 + self.grace
        log.info("stopping: waiting up to %g s for %d calls in flight", self.grace, len(self.capture.live))
        while self.capture.live and time.monotonic() < deadline and not self.hurry.is_set():
            try:
                await asyncio.wait_for(self.hurry.wait(), 0.05)
            except TimeoutError:
                pass
        n = self.capture.record_shutdown(time.monotonic() - t0)
        if n:
            log.warning("stopping: %d calls still in flight recorded as 'shutdown' error spans", n)
        self.master.shutdown()


class MemoryTrim:
    """Hand memory back to the OS after large bodies. A finished flow's bodies sit in reference
    cycles (mitmproxy's flows and layers) until a full collection, and glibc keeps freed pages, so
    RSS stayed up by hundreds of MB after a few big calls; ``gc.collect()`` + ``malloc_trim(0)``
    return them. Runs a quarter second after a large body, then once a second while large bodies
    were seen in the last few seconds, never per request. No-op without glibc."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        self._trim = getattr(libc, "malloc_trim", None)
        self.until = 0.0
        self.timer: asyncio.TimerHandle | None = None

    def note(self, nbytes: int) -> None:
        if self._trim is None:
            return
        self.until = time.monotonic() + 5.0
        if self.timer is None:  # soon: the flow is usually gone a moment after its span
            self.timer = asyncio.get_running_loop().call_later(0.25, self._tick)

    def _tick(self) -> None:
        gc.collect()  # mitmproxy's flows and layers sit in reference cycles: freed only by the collector
        self._trim(0)
        self.timer = None
        if time.monotonic() < self.until:
            self.timer = asyncio.get_running_loop().call_later(1.0, self._tick)


def _wire_stop(master, addons, config: ProxyConfig) -> None:
    from .addons import Capture, Limits

    capture = next(a for a in addons if isinstance(a, Capture))
    limits = next(a for a in addons if isinstance(a, Limits))
    capture.on_large_body = MemoryTrim().note
    stop = GracefulStop(master, capture, limits, config.shutdown_grace)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


async def _serve(config: ProxyConfig) -> int:
    from mitmproxy.options import Options
    from mitmproxy.proxy import server as mitm_server

    from .addons import build_addons

    confdir = config.resolved_confdir
    confdir.mkdir(parents=True, exist_ok=True)
    bundle = write_ca_bundle(confdir)
    host = config.listen_host
    opts = Options(
        mode=[f"regular@{host}:{config.forward_port}", f"reverse:{reverse_spec(config)}@{host}:{config.reverse_port}"],
        confdir=str(confdir),
    )
    master = make_master(opts, lean=config.lean)
    master.options.update(
        connection_strategy="lazy",  # never dial upstream before we routed the request
        upstream_cert=False,  # route hosts such as api.openai.com need not be reachable
        # a tunnel's bytes are HTTP or TLS, never passed through raw: mitmproxy guesses "not HTTP" from
        # a first write of under 3 bytes or a leading CRLF, and a CONNECT to the engine then carried a
        # request split that way past every addon (administration, unrecorded generations)
        rawtcp=False,
        ssl_insecure=config.ssl_insecure,
    )
    if config.no_intercept:
        master.options.update(ignore_hosts=list(config.no_intercept))
    if config.upstream_ca:
        master.options.update(ssl_verify_upstream_trusted_ca=str(Path(config.upstream_ca).resolve()))
    if config.idle_timeout != mitm_server.TCP_TIMEOUT:
        mitm_server.TCP_TIMEOUT = config.idle_timeout  # read per connection; no option exists in 11.0.2
    if config.gc_young > 0:  # the older generations keep Python's ratios to it (see the option's help)
        gc.set_threshold(config.gc_young, *gc.get_threshold()[1:])
    log.info("python gc thresholds %s", gc.get_threshold())
    state = ProxyState(config)
    addons = build_addons(state)
    master.addons.add(*addons)
    _wire_stop(master, addons, config)
    log.info(
        "lightning-proxy: forward http://%s:%s reverse http://%s:%s upstreams=%s traces=%s ca_bundle=%s",
        host, config.forward_port, host, config.reverse_port,
        [u.display for u in config.upstreams], config.traces, bundle,
    )
    log.info(
        'harness environment: eval "$(lightning-proxy env ROLLOUT_ID --forward-port %s --reverse-port %s --confdir '
        '%s%s)"',
        config.forward_port, config.reverse_port, confdir, " --token $LIGHTNING_PROXY_TOKEN" if config.token else "",
    )
    if not config.token:
        log.warning("no --token: any client can write traces through this proxy")
    try:
        await master.run()
    finally:
        state.close()
        if left_out := LINES.left_out():
            log.info("log lines left out since their last line: %s", left_out)
        log.info("lightning-proxy stopped: %s", state.snapshot())
    return 0


def serve(config: ProxyConfig) -> int:
    _setup_logging()
    Path(config.traces).mkdir(parents=True, exist_ok=True)
    return asyncio.run(_serve(config))
