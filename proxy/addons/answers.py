"""The proxy's own JSON answers (refusals and errors of every addon), built in one place."""

from __future__ import annotations

import json

from mitmproxy import http


def json_answer(flow: http.HTTPFlow, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    """Answer ``flow`` now; nothing is forwarded upstream."""
    flow.response = http.Response.make(status, json.dumps(body).encode(),
                                       {"Content-Type": "application/json", **(headers or {})})


def error_answer(flow: http.HTTPFlow, status: int, kind: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
    """An OpenAI-style error, the shape a harness's SDK parses into its exception."""
    json_answer(flow, status, {"error": {"message": message, "type": kind, "code": status}}, headers)
