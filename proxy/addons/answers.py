"""The proxy's own JSON answers (refusals and errors of every addon), built in one place."""

from __future__ import annotations

import json

from mitmproxy import http

ANSWERED = "lh.answered"  # flow.metadata key: the response is the proxy's own (a span must not blame upstream)


def json_answer(flow: http.HTTPFlow, status: int, body: dict | bytes, headers: dict[str, str] | None = None) -> None:
    """Answer ``flow`` now; nothing is forwarded upstream. ``body``: an object, or JSON bytes as given."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    flow.response = http.Response.make(status, content, {"Content-Type": "application/json", **(headers or {})})
    flow.metadata[ANSWERED] = True


def error_answer(flow: http.HTTPFlow, status: int, kind: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
    """An OpenAI-style error, the shape a harness's SDK parses into its exception."""
    json_answer(flow, status, {"error": {"message": message, "type": kind, "code": status}}, headers)
