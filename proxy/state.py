"""Shared state of one proxy process, and the per-flow record the addons fill in turn.

The addons are small and single-purpose; they talk through two objects only: :class:`ProxyState`
(one per process: config, writers, counters, the pause gate) and :class:`Call` (one per flow, in
``flow.metadata["lh"]``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..schemas import BufferFull, PartWriter
from ..schemas.compact import PeriodicCompactor
from .config import ProxyConfig, Upstream
from .credentials import Revocations
from .hosts import HostAddresses
from .redact import Redactor, environment_secrets

log = logging.getLogger("lightning.proxy")

META = "lh"  # key of the Call in flow.metadata

# what a flow is, decided by the attribution addon
MODEL = "model"  # chat/completions, completions or responses: captured
CONTROL = "control"  # /_lh/* control API
REWARD = "reward"  # a harness reporting its own reward
OTHER = "other"  # any other traffic: forwarded untouched, not recorded



def keep_newest(lru: collections.OrderedDict, key: Any, value: Any, limit: int) -> Any:
    """``value`` set as ``lru``'s newest entry for ``key``, the oldest forgotten past ``limit`` entries:
    the memories kept per attempt or per answer, which a long run must not grow without bound."""
    lru.pop(key, None)
    lru[key] = value
    while len(lru) > limit:
        lru.popitem(last=False)
    return value

@dataclass
class Call:
    """What the addons know about one flow (``flow.metadata["lh"]``)."""

    kind: str = OTHER
    mode: str = "forward"  # 'forward' or 'reverse'
    rollout_id: str | None = None
    attempt: int = 0
    endpoint: str | None = None  # 'chat.completions' | 'completions' | 'responses' | 'messages': what upstream speaks
    api: str | None = None  # what the harness speaks when the proxy translates ('messages' sent upstream as chat)
    scheme: str | None = None  # as the harness addressed it
    host: str | None = None
    path: str | None = None  # credentials removed
    # request
    request_text: str | None = None
    request_obj: dict | None = None
    request_fast: bool = False  # orjson read the body: it may write it back (fastjson.loads_exact)
    api_request: dict | None = None  # the harness's request before translation (see ``api``)
    request_error: str | None = None
    model: str | None = None
    stream: bool = False
    accept_encoding: str | None = None  # the harness's own Accept-Encoding (upstream gets identity)
    # routing
    upstream: Upstream | None = None  # training upstream replica (None: not routed to the pool)
    upstream_display: str | None = None
    routed: bool = False  # sent where the configuration says (the pool, the reverse target), not where a harness chose
    hosted: bool = False  # sent to a hosted API's host (a route host), served by the pool
    served_model: str | None = None
    inject: bool = False
    injected_token_ids: bool = False
    injected_logprobs: bool = False
    # accounting
    seq: int | None = None
    model_version: int | None = None
    started: float | None = None  # time.time() when forwarded (after the gate)
    received: float = field(default_factory=time.time)
    in_flight: bool = False  # being captured (ProxyState.begin .. end)
    done: bool = False
    # response
    first_byte: float | None = None
    sse: Any = None  # (SSERelay, assembler) when streaming
    response_obj: dict | None = None
    response_error: str | None = None
    event_filters: list[Callable[[dict], dict]] = field(default_factory=list)
    # hygiene
    # values secret for this call, never recorded: its keys (proxy credential, Authorization / x-api-key /
    # api-key values: the redactor keeps them all) and its other credentials (the longest kept)
    key_secrets: set[str] = field(default_factory=set)
    secrets: set[str] = field(default_factory=set)
    salvaged: bool = False  # some bytes were not valid UTF-8 (decoded with replacement) or a field was out of range

    def answer_failed(self, message: str) -> None:
        """The answer failed mid-way (a stream's error, or events that cannot be read): the first
        such message is the span's error."""
        if self.response_error is None:
            self.response_error = message


class ProxyState:
    """Process-wide state: config, Parquet writers, counters and the pause gate."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.model_version = int(config.model_version)
        self.redactor = Redactor([config.token, config.control_token, *environment_secrets(os.environ)])
        self.spans = PartWriter(
            config.traces, "spans", flush_rows=config.flush_rows, flush_bytes=config.flush_bytes,
            flush_seconds=config.flush_seconds, fsync=config.fsync,
            max_buffer_bytes=config.max_buffer_bytes, on_full=self._spans_refused,
        )
        # a full rewards buffer raises BufferFull: the control API answers 503 and the harness retries
        self.rewards = PartWriter(config.traces, "rewards", flush_seconds=config.flush_seconds, fsync=config.fsync,
                                  max_buffer_bytes=config.max_buffer_bytes)
        # bounded file count: closed parts are compacted beside the writers (never blocks a write)
        self.compactor = PeriodicCompactor(config.traces, ("spans", "rewards"), config.compact_seconds,
                                           fsync=config.fsync).start()
        self.spans_dropped = 0  # spans refused by a full buffer (counted and logged, see _spans_refused)
        self.capture_rejected = 0  # model calls answered 503 because capture was unhealthy (reject policy)
        self._drop_logged_at = float("-inf")
        self.paused = False
        self.holding: set = set()  # the requests the pause holds (mitmproxy flows): see held
        self.in_flight = 0
        self.spans_captured = 0
        self.rewards_captured = 0
        self.errors = 0
        self.rejected = 0
        self.connections_closed = 0  # by the connections addon at max_connections
        self.revoked = Revocations()  # attempts ended by POST /_lh/end (credentials refused)
        self.hosts = HostAddresses()  # what forward-mode destination names stand for (the pool, the proxy)
        self.started_at = time.time()
        self._resume: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._seq: collections.OrderedDict[tuple[str | None, int], itertools.count] = collections.OrderedDict()
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._rr = itertools.count()
        self._later: collections.deque[Callable[[], None]] = collections.deque()
        self._later_scheduled = False

    # -- work done after the answer has gone out -------------------------------------------
    def later(self, work: Callable[[], None]) -> None:
        """Run ``work`` once the current hook has returned and mitmproxy has sent what it was
        about to send (the next turn of the loop), so that recording a span (validating, redacting,
        buffering it) is not part of the harness's latency. Outside a running loop: now.
        Everything that reads what was recorded (:meth:`flush`, :meth:`snapshot`, shutdown) runs
        the queue first, so nothing is ever missed or reordered."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            work()
            return
        self._later.append(work)
        if not self._later_scheduled:
            self._later_scheduled = True
            loop.call_soon(self.run_later)

    def run_later(self) -> None:
        self._later_scheduled = False
        while self._later:
            work = self._later.popleft()
            try:
                work()
            except Exception:  # a bug in one recording must not stop the others
                log.exception("recording a span failed")

    # -- events are created lazily, inside mitmproxy's loop ---------------------------------
    @property
    def resume_event(self) -> asyncio.Event:
        if self._resume is None:
            self._resume = asyncio.Event()
            if not self.paused:
                self._resume.set()
        return self._resume

    @property
    def idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if self.in_flight == 0:
                self._idle.set()
        return self._idle

    def pause(self) -> None:
        self.paused = True
        self.resume_event.clear()

    def resume(self) -> None:
        self.paused = False
        self.resume_event.set()

    def begin(self, call: Call) -> None:
        """A model call is forwarded: it is captured until :meth:`end`, and one sent where the
        configuration says (``routed``) counts as in flight for a swap's drain meanwhile (a server the
        harness chose is no engine: waiting for it held every harness's calls)."""
        call.in_flight = True
        if call.routed:
            self.in_flight += 1
            self.idle_event.clear()

    def end(self, call: Call) -> None:
        if call.in_flight:
            call.in_flight = False
            if call.routed:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.idle_event.set()

    def next_seq(self, rollout_id: str | None, attempt: int) -> int:
        key = (rollout_id, attempt)
        counter = self._seq.get(key)
        if counter is None:
            counter = self._seq[key] = itertools.count()
            if len(self._seq) > 200_000:  # bound memory on very long runs: the least recently used goes
                self._seq.popitem(last=False)  # (clearing all restarted live rollouts' seq at 0)
        else:
            self._seq.move_to_end(key)
        return next(counter)

    def replica_for(self, rollout_id: str | None) -> Upstream:
        """Sticky replica choice: one rollout always talks to the same replica (prefix cache)."""
        pool = self.config.upstreams
        if len(pool) == 1 or rollout_id is None:
            return pool[0] if len(pool) == 1 else pool[next(self._rr) % len(pool)]
        idx = self._sticky.get(rollout_id)
        if idx is None:
            idx = next(self._rr) % len(pool)
            self._sticky[rollout_id] = idx
            if len(self._sticky) > 100_000:
                self._sticky.popitem(last=False)
        return pool[idx]

    # -- capture health ---------------------------------------------------------------------
    def capture_healthy(self) -> bool:
        """Both writers stored their last part and have buffer room (see ``PartWriter.healthy``)."""
        return self.spans.healthy and self.rewards.healthy

    def retry_after_s(self) -> int:
        """Seconds a rejected harness should wait: until the writers' next retry, at least 1."""
        left = max(self.spans.retry_in, self.rewards.retry_in)
        return max(1, math.ceil(left))

    def _spans_refused(self, rows: list[dict], exc: BufferFull) -> None:
        """A finished call's span did not fit in the full buffer: counted, logged (at most 1 line/s)."""
        self.spans_dropped += len(rows)
        now = time.monotonic()
        if now - self._drop_logged_at >= 1.0:
            self._drop_logged_at = now
            which = ", ".join(f"{r.get('rollout_id')}~{r.get('attempt')} seq {r.get('seq')}" for r in rows)
            log.warning("span not recorded (%s); %d dropped in all: %s", which, self.spans_dropped, exc)

    def capture_health(self) -> dict:
        spans, rewards = self.spans.health(), self.rewards.health()
        latest = max((spans, rewards), key=lambda h: h["last_error_at"] or 0)
        return {
            "healthy": spans["healthy"] and rewards["healthy"],
            "capture_failure": self.config.capture_failure,
            "capture_error": latest["last_error"],
            "capture_error_at": latest["last_error_at"],
            "write_failures": spans["write_failures"] + rewards["write_failures"],
            "rows_lost": spans["rows_lost"] + rewards["rows_lost"],
            "spans_pending": spans["rows_pending"],
            "spans_salvaged": spans["rows_salvaged"],
            "spans_dropped": self.spans_dropped,
            "rewards_pending": rewards["rows_pending"],
            "rewards_refused": rewards["rows_refused"],
            "capture_rejected": self.capture_rejected,
        }

    @property
    def held(self) -> int:
        """Requests the pause holds whose client still waits for them. One whose client gave up (closed
        its connection: no longer readable) stays in ``holding`` until resume, which does not forward
        it, so it is not counted: what the trainer logs as ``proxy/held`` is harnesses kept waiting."""
        from mitmproxy.connection import ConnectionState  # (only the proxy, which holds flows, asks)

        return sum(1 for flow in self.holding
                   if flow.error is None and flow.client_conn.state & ConnectionState.CAN_READ)

    def snapshot(self) -> dict:
        self.run_later()
        return {
            "paused": self.paused,
            "in_flight": self.in_flight,
            "held": self.held,
            "spans_written": self.spans.rows_written,
            "spans_captured": self.spans_captured,
            "spans_buffered": self.spans.buffered,
            "rewards_written": self.rewards.rows_written,
            "rewards_captured": self.rewards_captured,
            "model_version": self.model_version,
            "errors": self.errors,
            "rejected": self.rejected,
            "connections_closed": self.connections_closed,
            **self.capture_health(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "forward_port": self.config.forward_port,
            "reverse_port": self.config.reverse_port,
        }

    def flush(self) -> None:
        """Write what is buffered now; a storage error is not raised but shows in ``snapshot()``."""
        self.run_later()
        for writer in (self.spans, self.rewards):
            try:
                writer.flush()
            except Exception:
                pass  # recorded in writer.health() and logged by the writer

    def close(self) -> None:
        """Flush and stop both writers; rows that still cannot be written are reported, not hidden."""
        self.run_later()
        self.compactor.close()
        self.hosts.close()
        for writer in (self.spans, self.rewards):
            try:
                writer.close()
            except Exception as exc:
                log.error("%d %s row(s) could not be written at shutdown and are lost: %s",
                          writer.buffered, writer.table, exc)
