"""Record every model call as one span row (Contract 1), streaming included.

Runs after the gate, control and routing addons and before rewrite, so it records the request as
the harness sent it and the response as upstream sent it (token ids and logprobs included).
SSE responses are relayed chunk by chunk (:class:`~lightning_harness.proxy.sse.SSERelay`) and
assembled into one completion object for the span. Upstream errors, timeouts, client disconnects,
streams cut short, refusals (limits addon) and malformed JSON become error spans; the proxy keeps
serving. Every attributed model call gets exactly one span: calls still in flight when the proxy
stops are recorded by :meth:`Capture.record_shutdown`. Bytes that are not UTF-8 are kept with
replacement characters (``salvaged``), never dropped and never handed to Parquet as bad text.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from datetime import UTC, datetime

from mitmproxy import http
from mitmproxy.connection import ConnectionState

from .. import fastjson
from ..anthropic import untranslatable
from ..assemble import MESSAGES, RESPONSES, assembler_for, behaviour_logprobs, token_fields, unfinished_response
from ..codec import TooLarge, client_accepts, decode_body, json_text, utf8_text
from ..lax import engine_flag
from ..sampling import sampling_json
from ..sse import SSERelay
from ..state import META, MODEL, Call, ProxyState
from .answers import ANSWERED
from .limits import REFUSED, refuse

UNREADABLE = "the request body is not valid text (UTF-8, or UTF-16/32 by its byte-order mark)"
log = logging.getLogger("lightning.proxy")

MAX_ERROR_BODY = 500


def _ts(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, tz=UTC)


def _valid_text(row: dict, skip: str = "request_json") -> bool:
    """Make every text field encodable as UTF-8 (JSON escapes such as ``\\ud800`` parse into lone
    surrogates Parquet cannot write); True if one had to be fixed."""
    fixed = False
    for key, value in row.items():
        if isinstance(value, str) and key != skip and not value.isascii():  # ASCII is valid UTF-8
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                row[key] = value.encode("utf-8", "replace").decode("utf-8")
                fixed = True
    return fixed


_INT_COLUMNS = {"attempt": 31, "seq": 31, "status_code": 31, "n_choices": 31, "model_version": 63}


def _fit_ints(row: dict) -> bool:
    """Integers the int32/int64 columns cannot hold (a hostile attempt number, say) become null
    instead of failing the whole part; True if one did. The text columns keep what was sent."""
    fixed = False
    for key, bits in _INT_COLUMNS.items():
        v = row.get(key)
        if isinstance(v, int) and not -(1 << bits) <= v < (1 << bits):
            row[key], fixed = None, True
    return fixed


def _aborted(answer) -> bool:
    """An answer one of whose choices the engine aborted (vLLM's ``finish_reason: "abort"``)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") == "abort"
                                             for c in choices)


def _head(answer: dict | None) -> dict | None:
    """An assembled stream's top-level scalars (its id, model, status), without its choices or
    output. Why: the call lives as long as mitmproxy's flow, which sits in reference cycles; a long
    stream's flow has aged into the oldest generation by its end and is freed only by a full
    collection, so the whole answer (a dict per token) would stay until then."""
    if not isinstance(answer, dict):
        return answer
    return {k: v for k, v in answer.items() if v is None or isinstance(v, (str, int, float))}


def _cut_short(exc: ValueError, text: str) -> bool:
    """A JSON body that is fine up to where it stops (the parser ran out of input)."""
    if not isinstance(exc, json.JSONDecodeError) or not text.strip():
        return False
    return exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")


def _guarded(hook):
    """A bug or an input nobody foresaw in a hook must not cost the call its span: log it and
    record an error span with what is known (once per call), then let mitmproxy go on."""

    @functools.wraps(hook)
    def run(self, flow: http.HTTPFlow) -> None:
        try:
            hook(self, flow)
        except Exception as exc:
            log.exception("capture %s failed", hook.__name__)
            call: Call | None = flow.metadata.get(META)
            if call is not None and call.kind == MODEL and not call.done:
                self._start(call)
                self._finish(flow, call, "malformed_response" if flow.response else "malformed_request",
                             f"capture failed in {hook.__name__} ({type(exc).__name__}: {exc})")

    return run


class Capture:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.redact = state.redactor
        self.live: dict[int, tuple[http.HTTPFlow, Call]] = {}  # model calls without a span yet
        self.on_large_body = None  # callable(nbytes): the server hands memory back after big bodies

    # -- request ----------------------------------------------------------------------------
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is not None and call.kind == MODEL and not call.done:
            self.live[id(call)] = (flow, call)  # from here on the call gets a span, whatever happens

    @_guarded
    def request(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind != MODEL or call.done:
            return
        self._note_size(len(flow.request.raw_content or b""))
        if REFUSED in flow.metadata:  # answered by the limits addon (too large, shutting down, bad coding)
            self._record_refused(flow, call)
            return
        if flow.response is not None:  # answered by routing (no upstream configured): no span, as ever
            self.live.pop(id(call), None)
            return
        if flow.error is not None:  # the client gave up while the request was held
            self._start(call)
            self._finish(flow, call, "client_disconnect", f"client disconnected while held: {flow.error.msg}")
            return
        text, bad = json_text(flow.request.raw_content or b"")
        call.salvaged |= bad
        call.request_text = text
        if bad:
            # the engine refuses it (400), so does the proxy: sent on unread, it skipped every check that
            # reads a request (another rollout's stored response named); salvaged and rewritten, the
            # engine served a call it would have refused
            refuse(self.state, flow, 400, "malformed_request", UNREADABLE)
            self._record_refused(flow, call)
            return
        self._parse_request(call, text)
        self._start(call)
        self.state.begin(call)  # (the encoding addon asks upstream for an uncompressed body)

    def _record_refused(self, flow: http.HTTPFlow, call: Call) -> None:
        kind, why, status = flow.metadata[REFUSED]
        self._start(call)
        self._finish(flow, call, kind, why, response_json=flow.response.get_text(strict=False), status=status)

    @staticmethod
    def _parse_request(call: Call, text: str) -> None:
        try:
            obj, call.request_fast = fastjson.loads_exact(text)  # rewritten later: numbers must stay exact
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        except (ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
            call.request_error = f"request body is not valid JSON ({exc}); forwarded unchanged"
        else:
            call.request_obj = obj
            model = obj.get("model")
            call.model = model if isinstance(model, str) else None
            call.stream = engine_flag(obj.get("stream"))

    def _start(self, call: Call) -> None:
        """Seq and policy version, once: when the request is complete, or when it fails before."""
        if call.seq is None:
            call.seq = self.state.next_seq(call.rollout_id, call.attempt)
            call.model_version = self.state.model_version
            call.started = time.time()

    def _note_size(self, n: int) -> None:
        if self.on_large_body is not None and n >= 1 << 20:
            self.on_large_body(n)

    # -- response ---------------------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or not call.in_flight:
            return
        call.first_byte = time.time()
        ctype = flow.response.headers.get("Content-Type", "")
        if "text/event-stream" in ctype:
            asm = assembler_for(call.endpoint)
            relay = SSERelay(asm.add, call.event_filters, on_error=call.answer_failed,
                             max_event=self.state.config.max_decoded_size)
            call.sse = (relay, asm)
            flow.response.stream = relay
            if call.event_filters:  # events rewritten (injected fields stripped): not the bytes upstream
                flow.response.headers.pop("Content-Length", None)  # counted; the body ends with the connection

    @_guarded
    def response(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or not call.in_flight:
            return
        resp = flow.response
        if call.sse is not None:
            response_json, kind, err = self._stream_result(call, resp.status_code)
        else:
            response_json, kind, err = self._body_result(call, resp)
        status = resp.status_code
        whole_message = call.sse is None and call.api == MESSAGES and kind is None and status < 400
        failed = untranslatable(call.response_obj) if whole_message else None
        if failed is not None:  # the harness gets vLLM's error for it (addons/messages.py), not this answer
            kind, status = "malformed_response", failed.status
            err = f"no Messages answer can be made of it (the harness got HTTP {failed.status}): {failed}"
        if resp.status_code >= 400:
            kind = "upstream_status"
            body = (response_json or "")[:MAX_ERROR_BODY]
            who = "the proxy answered" if flow.metadata.get(ANSWERED) else "upstream answered"
            err = f"{who} HTTP {resp.status_code}: {body}"
        if call.request_error:
            kind, err = "malformed_request", call.request_error + (f"; {err}" if err else "")
        if kind == "too_large" and call.sse is None and not self._client_takes_coding(call, resp):
            status = 502  # the encoding addon answers 502 instead of expanding the bomb
        self._finish(flow, call, kind, err, response_json=response_json, status=status)

    @staticmethod
    def _client_takes_coding(call: Call, resp: http.Response) -> bool:
        return client_accepts(call.accept_encoding, resp.headers.get("Content-Encoding", "").strip().lower())

    @staticmethod
    def _streamed_json(call: Call) -> str:
        """The assembled stream so far as the span's response (and its salvaged flag on the call)."""
        relay, asm = call.sse
        relay.settle()  # a stream cut short: the events held so far
        call.response_obj = asm.result()
        call.salvaged |= relay.salvaged
        return fastjson.dumps_text(call.response_obj)

    def _stream_result(self, call: Call, status: int) -> tuple[str, str | None, str | None]:
        relay, asm = call.sse
        response_json = self._streamed_json(call)
        if relay.oversize:
            return response_json, "too_large", call.response_error
        if call.response_error or asm.error:
            return response_json, "malformed_response", call.response_error or asm.error
        if status < 400 and not self._whole(call):
            return response_json, "truncated", (
                f"event stream ended without its final event ([DONE], a finish_reason or response.completed) "
                f"after {relay.events} events ({relay.bytes} bytes): the answer is incomplete")
        return response_json, None, None

    @staticmethod
    def _whole(call: Call) -> bool:
        """Whether the stream so far holds its final event (a Responses stream only with
        ``response.completed`` or the like: ``[DONE]`` alone gave the client no response). Settles
        the relay (it hands events over in batches), so the error hook can ask before it assembles
        the answer, and leave that to the response hook for a whole stream (assembled once)."""
        relay, asm = call.sse
        relay.settle()
        return asm.finished if call.endpoint == RESPONSES else (relay.done or asm.finished)

    def _body_result(self, call: Call, resp: http.Response) -> tuple[str | None, str | None, str | None]:
        if resp.raw_content is None:
            return None, None, None
        raw = resp.raw_content
        self._note_size(len(raw))
        coding = resp.headers.get("Content-Encoding", "").strip()
        if coding and coding.lower() != "identity":
            try:
                raw = decode_body(raw, coding, self.state.config.max_decoded_size)
            except TooLarge as exc:
                return None, "too_large", f"upstream answer: {exc} (max_decoded_size)"
            except ValueError as exc:
                return None, "malformed_response", f"upstream answer: {exc}"
        text, bad = utf8_text(raw)
        call.salvaged |= bad
        try:
            obj = fastjson.loads(text or "")
        except (ValueError, RecursionError) as exc:
            if resp.status_code >= 400:
                return text, None, None
            if _cut_short(exc, text):
                return text, "truncated", f"upstream JSON body ends mid-value ({exc}): the answer is incomplete"
            return text, "malformed_response", f"upstream response is not valid JSON ({exc})"
        call.response_obj = obj if isinstance(obj, dict) else None
        if call.endpoint == RESPONSES and call.response_obj is not None and resp.status_code < 400:
            return text, *unfinished_response(call.response_obj)
        return text, None, None

    @_guarded
    def error(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind != MODEL or call.done:
            return
        msg = flow.error.msg if flow.error else "unknown error"
        refused = flow.metadata.get(REFUSED)
        if refused is None and call.seq is not None and call.sse is not None and flow.response is not None \
                and self._whole(call):
            # the harness read the final event, then closed the connection or reset the stream (an
            # HTTP/2 client such as Codex resets it then): the answer is whole, the call is not an error
            return self.response(flow)
        response_json = self._streamed_json(call) if call.sse is not None else None
        if refused is not None and call.seq is None:  # cut off by the limits addon, body never read
            self._start(call)
            kind, msg, status = refused
        elif call.seq is None:  # the request hook never ran: the body never arrived in full
            self._start(call)
            kind, status = "client_disconnect", None
            msg = f"client stopped before sending the whole request body: {msg}"
        else:
            kind, status, msg = self._classify_error(flow, call, msg)
        if call.request_error:
            msg = call.request_error + "; " + msg
        self._finish(flow, call, kind, msg, response_json=response_json, status=status)

    def _classify_error(self, flow: http.HTTPFlow, call: Call, msg: str) -> tuple[str, int | None, str]:
        low = msg.lower()
        idle = self.state.config.idle_timeout
        last_chunk = call.sse[0].last_chunk if call.sse is not None else None
        last_activity = last_chunk or call.first_byte or call.started or call.received
        # the client is gone when the proxy can no longer write to it: over HTTP/2 its leaving reads
        # "peer closed connection" or "stream reset by client", which an upstream failure can read too
        client_gone = not flow.client_conn.state & ConnectionState.CAN_WRITE or "client disconnected" in low \
            or "client closed" in low or "reset by client" in low
        sent = self._status_sent(flow)
        if client_gone and time.time() - last_activity >= idle * 0.95:
            # mitmproxy's inactivity watchdog closes the client side: it reads as a disconnect
            return "timeout", sent, f"no bytes from upstream for {idle:g} s (idle timeout); connection closed: {msg}"
        if client_gone:
            return "client_disconnect", sent, f"client disconnected before the response finished: {msg}"
        # the harness is still there: where no head went out (before answering, or a buffered answer
        # cut mid-body), mitmproxy answers it 502, the only code it sends for an upstream failure
        status = 502 if sent is None else sent
        if "timed out" in low or "timeout" in low:
            return "timeout", status, f"upstream timed out: {msg}"
        where = "mid-response" if flow.response else "before answering"
        return "upstream_unreachable", status, f"upstream failed {where}: {msg}"

    @staticmethod
    def _status_sent(flow: http.HTTPFlow) -> int | None:
        """The status the harness already got for a call that fails now: a streamed answer's
        (mitmproxy sends its head as soon as it comes, before the body is relayed; a call cut short
        after that returned the upstream's status, the schema's null is for none returned); None
        for an answer that had not begun or is buffered (nothing of it went out yet)."""
        resp = flow.response
        return resp.status_code if resp is not None and resp.stream else None

    # -- shutdown ---------------------------------------------------------------------------
    def record_shutdown(self, waited: float) -> int:
        """Give every call still without a span a ``shutdown`` error span (what had streamed so far
        included); returns how many. Called by the server after the drain, before the final flush."""
        self.state.run_later()
        n = 0
        for flow, call in list(self.live.values()):
            if call.done:
                continue
            self._start(call)
            response_json = self._streamed_json(call) if call.sse is not None else None
            msg = f"the proxy shut down while the call was in flight (after waiting {waited:.1f} s for it)"
            self._finish(flow, call, "shutdown", msg, response_json=response_json, status=self._status_sent(flow))
            n += 1
        return n

    # -- span row ---------------------------------------------------------------------------
    def _finish(self, flow, call: Call, kind, err, response_json=None, status=None) -> None:
        if call.done:
            return
        call.done = True
        self.live.pop(id(call), None)
        self._note_size(len(call.request_text or "") + len(response_json or ""))
        self.state.end(call)
        if kind is None and _aborted(call.response_obj):  # a swap's engine pause after a drain that timed out
            kind, err = "truncated", ("the engine aborted the answer (finish_reason 'abort': a weight swap whose "
                                      "drain timed out, or the engine stopped it): it is incomplete")
        if kind is None and call.model_version is not None and call.model_version != self.state.model_version:
            kind, err = "version_changed", (  # a drain that timed out, a call let in while paused, or one
                # kept through the swap (proxy.in_flight: keep): the engine may have generated it, or part
                # of it, with the next weights; never trained on
                f"the model version changed from {call.model_version} to {self.state.model_version} while the "
                "call was in flight: its tokens may come from either weights")
        row = self._row(flow, call, kind, err, response_json, status)  # now: rewrite edits the answer next
        if call.sse is not None:  # the span holds the answer; later hooks read only its head (a stored id)
            call.response_obj = _head(call.response_obj)
        self.state.later(lambda: self._record(row, call))

    def _record(self, row: dict, call: Call) -> None:
        """Validate, redact and buffer a span row (after the answer has gone out: state.later)."""
        row["salvaged"] = _valid_text(row) | _fit_ints(row) or row["salvaged"]
        row = self._scrubbed(row, call)
        if row["error_kind"]:
            self.state.errors += 1
            log.info("error span %s/%s seq=%s: %s: %.300s", call.rollout_id, call.attempt, call.seq,
                     row["error_kind"], row["error"])
        self.state.spans.append(row)
        self.state.spans_captured += 1

    def _scrubbed(self, row: dict, call: Call) -> dict:
        """The row through the redactor (the one redaction point). If redaction itself fails on a
        hostile body, the span is still written, without its texts: never unredacted, never lost."""
        try:
            # a translated Messages call: the chat request vLLM tokenised joins the harness's system (and
            # thinking) blocks with nothing, so a key split over two blocks is whole only there
            sent = fastjson.dumps_text(call.request_obj) if call.api == MESSAGES and call.request_obj else None
            return self.redact.scrub_row(row, call.secrets, keys=call.key_secrets,
                                         request_is_json=call.request_obj is not None, sent=sent)
        except Exception as exc:
            log.warning("redaction failed (%s: %s); span kept without its texts", type(exc).__name__, exc)
            row.update(request_json=None, response_json=None, path=None, salvaged=True,
                       error=f"redaction failed ({type(exc).__name__}); request and response text dropped")
            return row

    def _row(self, flow, call: Call, kind, err, response_json, status) -> dict:
        now = time.time()
        try:
            toks = token_fields(call.response_obj, call.endpoint)
        except Exception as exc:  # an answer of an unexpected shape: keep it in response_json only
            log.warning("token fields not extracted (%s: %s)", type(exc).__name__, exc)
            toks = {**token_fields(None, call.endpoint), "salvaged": True}
        salvaged = toks.pop("salvaged", False) or call.salvaged
        if not call.routed:  # ids and logprobs from a server the harness chose are whatever it made up
            toks.update(prompt_token_ids=None, response_token_ids=None, response_logprobs=None)
        toks["response_logprobs"] = behaviour_logprobs(call.request_obj, call.endpoint, toks["response_logprobs"])
        row = {
            "span_id": uuid.uuid4().hex,
            "rollout_id": call.rollout_id,
            "attempt": call.attempt,
            "seq": call.seq,
            "started_at": _ts(call.received),
            "ended_at": _ts(now),
            "latency_ms": (now - call.received) * 1000.0,
            "ttft_ms": None if call.first_byte is None else (call.first_byte - call.received) * 1000.0,
            "mode": call.mode,
            "endpoint": call.api or call.endpoint,
            "method": flow.request.method,
            "scheme": call.scheme,
            "host": call.host,
            "path": call.path,
            "upstream": call.upstream_display,
            "routed": call.routed,
            "model": call.model,
            "served_model": call.served_model or call.model,
            "model_version": call.model_version if call.model_version is not None else self.state.model_version,
            "status_code": status,
            "stream": call.stream,
            "request_json": call.request_text,
            "response_json": response_json,
            "sampling_json": sampling_json(call.request_obj, call.endpoint),
            "token_ids_injected": call.injected_token_ids or call.injected_logprobs,
            "error_kind": kind,
            "error": err,
            **toks,
        }
        row["salvaged"] = salvaged  # and what _record finds
        return row
