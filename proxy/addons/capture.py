"""Record every model call as one span row (Contract 1), streaming included.

Runs after the gate, control and routing addons and before rewrite, so it records the request as
the harness sent it and the response as upstream sent it (token ids and logprobs included).
SSE responses are relayed chunk by chunk (:class:`~lightning_harness.proxy.sse.SSERelay`) and
assembled into one completion object for the span. Upstream errors, timeouts, client disconnects
and malformed JSON become error spans; the proxy keeps serving.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import datetime, timezone

from mitmproxy import http

from ..assemble import assembler_for, token_fields
from ..sse import SSERelay
from ..state import META, MODEL, Call, ProxyState

log = logging.getLogger("lightning.proxy")

MAX_ERROR_BODY = 500


def _ts(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, tz=timezone.utc)


class Capture:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.redact = state.redactor

    # -- request ----------------------------------------------------------------------------
    def request(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind != MODEL or call.done or flow.response is not None:
            return
        if flow.error is not None:  # the client gave up while the request was held
            self._finish(flow, call, "client_disconnect", f"client disconnected while held: {flow.error.msg}")
            return
        text = flow.request.get_text(strict=False) or ""
        call.request_text = text
        try:
            obj = json.loads(text)
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        except ValueError as exc:
            call.request_error = f"request body is not valid JSON ({exc}); forwarded unchanged"
        else:
            call.request_obj = obj
            model = obj.get("model")
            call.model = model if isinstance(model, str) else None
            call.stream = bool(obj.get("stream"))
        call.seq = self.state.next_seq(call.rollout_id, call.attempt)
        call.model_version = self.state.model_version
        call.started = time.time()
        self.state.begin(call)  # (the encoding addon asks upstream for an uncompressed body)

    # -- response ---------------------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or not call.in_flight:
            return
        call.first_byte = time.time()
        ctype = flow.response.headers.get("Content-Type", "")
        if "text/event-stream" in ctype:
            asm = assembler_for(call.endpoint)
            relay = SSERelay(asm.add, call.event_filters, on_error=self._sse_error(call))
            call.sse = (relay, asm)

            def stream(chunk: bytes, relay=relay, call=call):
                call.last_chunk = time.time()
                return relay(chunk)

            flow.response.stream = stream

    @staticmethod
    def _sse_error(call: Call):
        def on_error(msg: str) -> None:
            if call.response_error is None:
                call.response_error = msg

        return on_error

    def response(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or not call.in_flight:
            return
        resp = flow.response
        kind = err = None
        if call.sse is not None:
            call.response_obj = call.sse[1].result()
            response_json = json.dumps(call.response_obj, ensure_ascii=False)
            if call.response_error:
                kind, err = "malformed_response", call.response_error
        else:
            response_json = resp.get_text(strict=False) if resp.raw_content is not None else None
            try:
                obj = json.loads(response_json or "")
                call.response_obj = obj if isinstance(obj, dict) else None
            except ValueError as exc:
                if resp.status_code < 400:
                    kind, err = "malformed_response", f"upstream response is not valid JSON ({exc})"
        if resp.status_code >= 400:
            kind = "upstream_status"
            body = (response_json or "")[:MAX_ERROR_BODY]
            err = f"upstream answered HTTP {resp.status_code}: {body}"
        if call.request_error:
            kind, err = "malformed_request", call.request_error + (f"; {err}" if err else "")
        self._finish(flow, call, kind, err, response_json=response_json, status=resp.status_code)

    def error(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind != MODEL or call.done:
            return
        msg = flow.error.msg if flow.error else "unknown error"
        low = msg.lower()
        response_json = None
        if call.sse is not None:
            call.response_obj = call.sse[1].result()
            response_json = json.dumps(call.response_obj, ensure_ascii=False)
        idle = self.state.config.idle_timeout
        last_activity = call.last_chunk or call.first_byte or call.started or call.received
        if "client disconnected" in low and time.time() - last_activity >= idle * 0.95:
            # mitmproxy's inactivity watchdog closes the client side: it reads as a disconnect
            kind, status = "timeout", None
            msg = f"no bytes from upstream for {idle:g} s (idle timeout); connection closed: {msg}"
        elif "client disconnected" in low or "client closed" in low:
            kind, status = "client_disconnect", None
            msg = f"client disconnected before the response finished: {msg}"
        elif "timed out" in low or "timeout" in low:
            kind, status = "timeout", None if flow.response else 504
            msg = f"upstream timed out: {msg}"
        else:
            kind = "upstream_unreachable"
            status = None if flow.response else 502
            where = "mid-response" if flow.response else "before answering"
            msg = f"upstream failed {where}: {msg}"
        if call.request_error:
            msg = call.request_error + "; " + msg
        self._finish(flow, call, kind, msg, response_json=response_json, status=status)

    # -- span row ---------------------------------------------------------------------------
    def _finish(self, flow, call: Call, kind, err, response_json=None, status=None) -> None:
        if call.done:
            return
        call.done = True
        self.state.end(call)
        now = time.time()
        toks = token_fields(call.response_obj, call.endpoint)
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
            "endpoint": call.endpoint,
            "method": flow.request.method,
            "scheme": call.scheme,
            "host": call.host,
            "path": call.path,
            "upstream": call.upstream_display,
            "model": call.model,
            "served_model": call.served_model or call.model,
            "model_version": call.model_version if call.model_version is not None else self.state.model_version,
            "status_code": status,
            "stream": call.stream,
            "request_json": call.request_text,
            "response_json": response_json,
            "token_ids_injected": call.injected_token_ids or call.injected_logprobs,
            "error_kind": kind,
            "error": err,
            **toks,
        }
        row = self.redact.scrub_row(row, call.secrets, request_is_json=call.request_obj is not None)
        if kind:
            self.state.errors += 1
            log.info("error span %s/%s seq=%s: %s: %s", call.rollout_id, call.attempt, call.seq, kind, err)
        self.state.spans.append(row)
        self.state.spans_captured += 1
