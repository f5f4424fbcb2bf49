"""The proxy's own JSON answers (refusals and errors of every addon), built in one place."""

from __future__ import annotations

import json
import logging

from mitmproxy import http

log = logging.getLogger("lightning.proxy")

ANSWERED = "lh.answered"  # flow.metadata key: the response is the proxy's own (a span must not blame upstream)


def json_answer(flow: http.HTTPFlow, status: int, body: dict | bytes, headers: dict[str, str] | None = None) -> None:
    """Answer ``flow`` now; nothing is forwarded upstream. ``body``: an object, or JSON bytes as given."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    flow.response = http.Response.make(status, content, {"Content-Type": "application/json", **(headers or {})})
    flow.metadata[ANSWERED] = True


def rewrite_failed(flow: http.HTTPFlow, call, what: str, exc: Exception, body: dict | None = None) -> None:
    """A request the proxy failed to rewrite (a bug, or an input nobody foresaw) is answered 500, never
    sent on half done: upstream it would be served as another call than the span says (a Messages
    body sent untranslated, a call recorded as injected that was not). Logged with its traceback;
    capture records the call as an error span."""
    log.exception("%s failed", what)
    call.request_error = f"lightning-proxy: {what} failed ({type(exc).__name__})"
    call.request_obj = None  # nothing for a later addon to edit
    json_answer(flow, 500, body or {"error": {"message": call.request_error, "type": "proxy_error", "code": 500}})


def error_answer(flow: http.HTTPFlow, status: int, kind: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
    """An OpenAI-style error, the shape a harness's SDK parses into its exception."""
    json_answer(flow, status, {"error": {"message": message, "type": kind, "code": status}}, headers)
