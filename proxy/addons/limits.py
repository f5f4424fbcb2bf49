"""Bounds on model-call request bodies (and the announced length of a harness's reward), and the door
closed while the proxy shuts down.

A hostile or broken harness can send a body far bigger than any prompt (memory), or a small
compressed body that expands a thousandfold (a decompression bomb). Model calls are refused with
413 and an OpenAI-style JSON error when:
- ``Content-Length`` exceeds ``max_body_size`` (checked on the headers, before the body is used;
  beyond twice the limit the connection is closed at once instead, so the body is never read);
- a chunked body (no length) turns out longer than ``max_body_size``; past twice that, the
  connection is closed at once (``read_at_most``), so the rest is never read;
- a ``Content-Encoding`` body (gzip, deflate, br, zstd) would expand past ``max_decoded_size``:
  it is decompressed with a running cap, never with an uncapped decode.
An accepted compressed body is forwarded decoded (``identity``): the span, the rewrite addon and
upstreams that do not read compressed requests (vLLM) all need the plain JSON. While the proxy
drains at shutdown new model calls get 503. Bodies of 64 KiB and more share a budget of
``max_inflight_bytes`` being processed at once; past it a call waits its turn, and a rollout's calls
beyond its first one in flight only use the budget's first half, so one rollout cannot stall the
others (:class:`ByteBudget`). What one rollout's bodies hold in the proxy at once, however many
connections it opens, is bounded by the same figure: past it the body being read is cut (:class:`HeldBodies`).
Answers to other traffic (not recorded) are streamed rather than held whole. Each refusal is
counted in ``rejected`` and the capture addon records it as an error span (``too_large``,
``malformed_request``, ``shutdown``), so no attributed model call goes unrecorded. Runs before routing and capture.
"""

from __future__ import annotations

import asyncio
import logging

from mitmproxy import http

from ...schemas.rewards import MAX_REWARD_BYTES
from ..codec import TooLarge, decode_body
from ..credentials import log_safe
from ..state import META, MODEL, OTHER, REWARD, Call, ProxyState
from .answers import error_answer
from .attribution import log_masked, loggable_url

log = logging.getLogger("lightning.proxy")

REFUSED = "lh.refused"  # flow.metadata key: (error_kind, message, status) of a call this addon answered
STREAM_OTHER_ABOVE = 1 << 20  # bytes: larger (or unannounced) answers to other traffic are streamed
BUDGETED = "lh.budget"  # flow.metadata key: (rollout id, bytes) this call holds of the in-flight budget
BUDGET_FROM = 64 << 10  # bodies this large or larger count against max_inflight_bytes
KILL_ABOVE = 2  # a Content-Length over this many times max_body_size: connection closed, body never read
READ_AT_MOST = "lh.read_at_most"  # flow.metadata key: (bound, rollout, HeldBodies) of a body mitmproxy reads
CUT_READING = "lh.cut_reading"  # flow.metadata key: set when bound_reading cut a body (counted, logged by Limits)
HELD = "lh.held"  # flow.metadata key: (rollout, bytes) of the flow's request body counted in HeldBodies
REFUSED_ON_HEADERS = "(refused on headers)"  # HeldBodies' count of such calls: never a rollout id (no spaces)
ANSWERED_READ = 64 << 10  # ... of a request already refused on its headers (no credentials): its answer waits for it


class ByteBudget:
    """Bytes of large request bodies being processed at once. A call that would go past the limit
    waits (like a paused call: held, not bounced) until others finish; one call alone always goes.
    Why: each call in flight costs several times its body (text, parsed JSON, rewritten body,
    Parquet row), so many concurrent big bodies could exhaust memory although each is allowed.

    A rollout's first call in flight may use the whole budget; a call of a rollout that already holds
    bytes goes only while everything in flight stays within half of it. Why: rollouts share a proxy
    and a harness is hostile (the policy writes its commands); under the budget alone one rollout's
    many big slow calls stalled every other rollout's big call. Extra calls now never hold more than
    half, so a rollout's first call waits only while other rollouts' first calls fill the other half:
    each rollout, however many calls it sends, holds up others with one. (A cap per rollout, its own
    holding under half, would still let two rollouts fill the budget.) Calls without a rollout id
    count as one rollout."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.held: dict[str | None, int] = {}  # rollout id -> bytes it holds; only rollouts holding some
        self._changed: asyncio.Event | None = None  # created inside mitmproxy's loop

    def fits(self, rollout: str | None, n: int) -> bool:
        if rollout in self.held:
            return self.used + n <= self.limit // 2
        return not self.used or self.used + n <= self.limit

    async def acquire(self, rollout: str | None, n: int) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        while not self.fits(rollout, n):
            self._changed.clear()
            await self._changed.wait()
        self.used += n
        self.held[rollout] = self.held.get(rollout, 0) + n

    def release(self, rollout: str | None, n: int) -> None:
        self.used -= n
        left = self.held.pop(rollout, 0) - n
        if left > 0:
            self.held[rollout] = left
        if self._changed is not None:
            self._changed.set()


class HeldBodies:
    """Bytes of request bodies each rollout holds in the proxy: being read, waiting for the budget,
    or in flight until the call ends. Past ``limit`` the body being read is cut (``bound_reading``).

    Why: each body has a bound, but mitmproxy holds a body whole before any addon (or the budget)
    sees it, so a rollout holding back the last byte of 96 bodies within ``max_body_size`` held
    96 MiB of the proxy, and as many more as it opened connections. A rollout's bodies now have one
    bound however many connections it opens; it cuts only that rollout's calls. Calls refused on
    their headers (no or bad credentials: a rollout id they claim is not theirs) count as one
    rollout, ``REFUSED_ON_HEADERS``, apart from the trainer's control calls (``None``, as any call
    of no rollout): anyone on the machine can send those, and they must not crowd out the trainer."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: dict[str | None, int] = {}

    def grow(self, flow: http.HTTPFlow, rollout: str | None, n: int) -> str | None:
        """The flow's body is ``n`` bytes so far: counted, or why it may not be (the count unchanged)."""
        total = self.held.get(rollout, 0) + n - flow.metadata.get(HELD, (rollout, 0))[1]
        if total > self.limit:
            return f"the rollout's request bodies in the proxy would pass {self.limit} bytes (max_inflight_bytes)"
        self.held[rollout] = total
        flow.metadata[HELD] = (rollout, n)
        return None

    def give_back(self, flow: http.HTTPFlow) -> None:
        """The call ended: its body is the rollout's again."""
        rollout, n = flow.metadata.pop(HELD, (None, 0))
        left = self.held.pop(rollout, 0) - n
        if left > 0:
            self.held[rollout] = left


def bound_reading() -> None:
    """Make mitmproxy stop reading a request body past its flow's ``READ_AT_MOST`` bytes: 413 (its
    error page; a call answered on its headers gets that answer) and the connection closed (an
    HTTP/2 stream reset), the rest unread. Installed once, on mitmproxy's per-chunk body check.

    Why: mitmproxy holds a request body whole before any addon sees it, and sends an answer an addon
    set on the headers only after the whole body came (its own ``body_size_limit`` is one figure for
    requests and answers, so it would cut downloads through the forward proxy too). A chunked model
    call announces no length to refuse it by, and a client without credentials, refused with 401 on its
    headers, had its body read whole all the same: 64 MiB sent to a proxy with a token took 64 MiB of
    its memory, unbounded, before the 401 went out. It names internals of mitmproxy 11.0.2 (the
    version pyproject.toml pins); tests/test_hostile_capture.py fails if they move."""
    from mitmproxy import flow as mitm_flow
    from mitmproxy.proxy.layers.http import (
        HttpErrorHook,
        HttpStream,
        ResponseData,
        ResponseEndOfMessage,
        ResponseHeaders,
        ResponseProtocolError,
        SendHttp,
    )

    check = HttpStream.check_body_size
    if getattr(check, "bounded", False):
        return

    def check_body_size(self, request: bool):
        reading = self.flow.metadata.get(READ_AT_MOST) if request else None
        if reading is None:
            return (yield from check(self, request))
        bound, rollout, bodies = reading
        n = len(self.request_body_buf)
        over = f"request body past {bound} bytes" if n > bound else bodies.grow(self.flow, rollout, n)
        if over is None:
            return (yield from check(self, request))
        answered, h2 = self.flow.response, self.context.client.alpn == b"h2"
        why = (f"lightning-proxy: {over}"
               + (f" on a call answered {answered.status_code} on its headers" if answered else "")
               + ("; stream reset" if h2 else "; connection closed") + ", the rest unread")
        self.flow.metadata.setdefault(REFUSED, ("too_large", why, 413))
        self.flow.metadata[CUT_READING] = True
        self.request_body_buf.clear()
        self.flow.error = mitm_flow.Error(why)
        yield HttpErrorHook(self.flow)  # (capture records a model call's too_large span)
        if answered:  # its own answer (401: no credentials...), not a 413 that would send the harness's
            if not h2:  # user looking for a prompt too large (HTTP/2 has no Connection header)
                answered.headers["Connection"] = "close"
            for event in (ResponseHeaders(self.stream_id, answered), ResponseData(self.stream_id, answered.raw_content),
                          ResponseEndOfMessage(self.stream_id)):
                yield SendHttp(event, self.context.client)
        yield SendHttp(ResponseProtocolError(self.stream_id, why, 413), self.context.client)  # (closes)
        if h2 and not answered:  # the answer is sent, the request not: reset the stream, or
            # an HTTP/2 client waits for a window to send the rest in (curl did, until its own timeout)
            yield SendHttp(ResponseProtocolError(self.stream_id, why, 413), self.context.client)
        self.client_state = self.state_errored
        self.flow.live = False
        return True

    check_body_size.bounded = True
    HttpStream.check_body_size = check_body_size


class Limits:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.draining = False  # set by the server on SIGTERM
        cfg = state.config
        self.budget = ByteBudget(cfg.max_inflight_bytes)
        self.bodies = HeldBodies(max(cfg.max_inflight_bytes, KILL_ABOVE * cfg.max_body_size))  # (one call always fits)
        bound_reading()

    @staticmethod
    def _model_call(flow: http.HTTPFlow) -> Call | None:
        call = flow.metadata.get(META)
        if call is None or call.kind != MODEL or call.done or flow.response is not None or REFUSED in flow.metadata:
            return None
        return call

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._check_headers(flow)
        flow.metadata[READ_AT_MOST] = (*self.read_at_most(flow), self.bodies)

    def read_at_most(self, flow: http.HTTPFlow) -> tuple[int, str | None]:
        """How much of this request's body mitmproxy may hold, and whose it is (``HeldBodies``). A
        body is refused past its bound anyway; twice the bound is read, as for an announced length
        (``KILL_ABOVE``), so a body a little too large still gets the JSON 413. Other traffic goes to
        the engine (which takes only reads from a harness) or is an upload to another host, which
        routing streams through (never held, so never cut)."""
        call = flow.metadata.get(META)
        if call is None or flow.response is not None and REFUSED not in flow.metadata:
            return ANSWERED_READ, REFUSED_ON_HEADERS  # (no or bad credentials): the body is not wanted
        bound = KILL_ABOVE * (MAX_REWARD_BYTES if call.kind == REWARD else self.state.config.max_body_size)
        return bound, call.rollout_id

    def _check_headers(self, flow: http.HTTPFlow) -> None:
        call = flow.metadata.get(META)
        if call is not None and call.kind == REWARD and flow.response is None:
            self._cut_off_reward(flow)
            return
        if self._model_call(flow) is None:
            return
        if self.draining:
            self.refuse(flow, 503, "shutdown", "the proxy is shutting down; retry on another proxy")
            return
        length = flow.request.headers.get("Content-Length", "")
        limit = self.state.config.max_body_size
        if not length.strip().isdigit() or int(length) <= limit:
            return
        why = f"request body of {int(length)} bytes exceeds the proxy's max_body_size ({limit} bytes)"
        if int(length) > KILL_ABOVE * limit:
            self.cut_off(flow, why)
        else:
            self.refuse(flow, 413, "too_large", why)

    def _cut_off_reward(self, flow: http.HTTPFlow) -> None:
        """A harness's reward announced past twice its bound (``MAX_REWARD_BYTES``; the control addon
        refuses one over it with 413 once read): the connection is closed, the body never read."""
        length = flow.request.headers.get("Content-Length", "").strip()
        if length.isdigit() and int(length) > KILL_ABOVE * MAX_REWARD_BYTES:
            self.cut_off(flow, f"reward body of {int(length)} bytes announced; a reward is at most "
                         f"{MAX_REWARD_BYTES} bytes")

    async def request(self, flow: http.HTTPFlow) -> None:
        self._check_body(flow)
        n = len(flow.request.raw_content or b"")
        call = self._model_call(flow)
        if n >= BUDGET_FROM and call is not None:
            await self.budget.acquire(call.rollout_id, n)
            flow.metadata[BUDGETED] = (call.rollout_id, n)

    def response(self, flow: http.HTTPFlow) -> None:
        self._release(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._release(flow)
        if flow.metadata.pop(CUT_READING, False):
            self._count_cut(flow, flow.metadata[REFUSED][1])

    def _release(self, flow: http.HTTPFlow) -> None:
        self.bodies.give_back(flow)
        held = flow.metadata.pop(BUDGETED, None)
        if held is not None:
            self.budget.release(*held)

    def _check_body(self, flow: http.HTTPFlow) -> None:
        """413 for a body (or its decoded form) over the limits; a compressed one forwarded decoded."""
        if self._model_call(flow) is None:
            return
        cfg = self.state.config
        raw = flow.request.raw_content or b""
        if len(raw) > cfg.max_body_size:  # chunked: no length was announced
            self.refuse(flow, 413, "too_large",
                        f"request body of {len(raw)} bytes exceeds the proxy's max_body_size ({cfg.max_body_size} "
                        f"bytes)")
            return
        coding = flow.request.headers.get("Content-Encoding", "").strip()
        if not coding or coding.lower() == "identity":
            return
        try:
            body = decode_body(raw, coding, cfg.max_decoded_size)
        except TooLarge as exc:
            self.refuse(flow, 413, "too_large", f"{exc} (max_decoded_size)")
            return
        except ValueError as exc:
            self.refuse(flow, 415 if "unsupported" in str(exc) else 400, "malformed_request", str(exc))
            return
        del flow.request.headers["Content-Encoding"]
        flow.request.content = body  # sets Content-Length too

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """Other traffic (downloads through the forward proxy: pip, git, ...) is never captured:
        stream its larger bodies through instead of letting mitmproxy hold them whole in memory."""
        call = flow.metadata.get(META)
        if call is None or call.kind != OTHER or flow.response.raw_content is not None or flow.response.stream:
            return
        length = flow.response.headers.get("Content-Length", "").strip()
        if not length.isdigit() or int(length) > STREAM_OTHER_ABOVE:
            flow.response.stream = True

    def cut_off(self, flow: http.HTTPFlow, why: str) -> None:
        """Close the connection now instead of answering 413. mitmproxy reads a whole body before it
        sends an answer an addon set, so a 413 for a 10 GB body would first hold 10 GB; a body
        announced this far over the limit is not read at all. Capture records a ``too_large`` span."""
        flow.metadata[REFUSED] = ("too_large", f"{why}; connection closed without reading the body", None)
        flow.kill()
        self._count_cut(flow, why)

    def _count_cut(self, flow: http.HTTPFlow, why: str) -> None:
        """A connection closed on a body too large (here, or by ``bound_reading``): counted in ``rejected``, logged."""
        self.state.rejected += 1
        redactor = self.state.redactor
        log.info("cut off %s %s: %s", log_safe(flow.request.method), loggable_url(flow, redactor),
                 log_masked(flow, why, redactor))

    def refuse(self, flow: http.HTTPFlow, status: int, kind: str, why: str) -> None:
        refuse(self.state, flow, status, kind, why)


def refuse(state: ProxyState, flow: http.HTTPFlow, status: int, kind: str, why: str) -> None:
    """Answer the call now with an OpenAI-style error; capture turns it into an error span."""
    state.rejected += 1
    flow.metadata[REFUSED] = (kind, why, status)
    error_answer(flow, status, kind, f"lightning-proxy: {why}")
    log.info("refused %s %s: %s", log_safe(flow.request.method), loggable_url(flow, state.redactor),
             log_masked(flow, why, state.redactor))
