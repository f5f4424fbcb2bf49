"""Anthropic Messages calls routed to the training pool: sent as chat completions, answered as Messages.

Two hooks must sit on either side of the rewrite addon (which injects ``return_token_ids`` and
``logprobs`` into the chat request and strips them from the chat answer), so this concern is two
small classes: :class:`MessagesRequest` (after capture, before rewrite) turns the Messages body into
the chat request (``proxy/anthropic.py``) and wraps the relay so the harness gets Messages events;
:class:`MessagesResponse` (after rewrite) turns a whole chat answer, or any error answer, into the
Messages shape (a chat answer vLLM's own ``/v1/messages`` fails, a tool call whose arguments do
not decode, gets the error it gives: ``anthropic.AnswerError``). The span keeps the Messages
request as the harness sent it and the chat answer as upstream sent it (token ids and logprobs
included), with ``endpoint = 'messages'``.

A Messages call not routed to the pool (a hosted ``api.anthropic.com`` harness without a route) is
forwarded untouched and recorded natively (no token ids). A body that is not a valid Messages request
gets 400 in the Anthropic error shape and an error span (``malformed_request``) with the body.
"""

from __future__ import annotations

import json

from mitmproxy import http

from ..anthropic import (
    MESSAGES,
    AnswerError,
    EventStream,
    EventTranslator,
    MessagesError,
    dumps,
    error_body,
    error_from,
    to_chat,
    to_message,
)
from ..assemble import CHAT
from ..state import META, MODEL, Call
from .answers import json_answer, rewrite_failed
from .limits import REFUSED


def _stops(call: Call):
    return (call.api_request or {}).get("stop_sequences")


class MessagesRequest:
    """Messages request -> chat-completions request, for calls routed to the training pool."""

    def request(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if (call is None or call.kind != MODEL or call.endpoint != MESSAGES or not call.in_flight
                or call.upstream is None or flow.response is not None):
            return
        call.api = MESSAGES
        if call.request_obj is None:
            self._refuse(flow, call, call.request_error or "the body is not a JSON object")
            return
        try:
            chat = to_chat(call.request_obj)
        except MessagesError as exc:
            call.request_error = f"not a valid Messages request: {exc}"
            self._refuse(flow, call, str(exc))
            return
        except Exception as exc:
            rewrite_failed(flow, call, "translating the Messages request", exc,
                           error_body(500, "lightning-proxy: translating the Messages request failed"))
            return
        call.api_request, call.request_obj = call.request_obj, chat
        call.endpoint = CHAT  # what upstream speaks now: rewrite injects, capture assembles as chat
        path, _, query = flow.request.path.partition("?")
        path = path.rstrip("/")  # ``/v1/messages/`` is a Messages call too (assemble.endpoint_of)
        flow.request.path = path[: -len("messages")] + "chat/completions" + (f"?{query}" if query else "")
        flow.request.content = dumps(chat)

    @staticmethod
    def _refuse(flow: http.HTTPFlow, call: Call, why: str) -> None:
        call.request_obj = None  # nothing for rewrite to edit
        json_answer(flow, 400, dumps(error_body(400, f"lightning-proxy: {why}")))

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.api != MESSAGES or call.sse is None or flow.response.stream is None:
            return
        translator = EventTranslator(call.model, _stops(call), on_error=call.answer_failed)
        flow.response.stream = EventStream(flow.response.stream, translator, max_event=call.sse[0].max_event)
        flow.response.headers["Content-Type"] = "text/event-stream; charset=utf-8"
        # the events sent are not the bytes upstream counted: the body ends with the connection
        flow.response.headers.pop("Content-Length", None)


class MessagesResponse:
    """Chat answer (already stripped by rewrite) -> Messages answer; errors in the Anthropic shape."""

    def response(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind != MODEL or call.sse is not None or flow.response is None:
            return
        translated = call.api == MESSAGES
        refused = call.endpoint == MESSAGES and REFUSED in flow.metadata  # the proxy's own answer
        if not (translated or refused):
            return
        resp = flow.response
        if resp.status_code >= 400:
            obj = call.response_obj if translated else None
            text = resp.get_text(strict=False) if resp.raw_content is not None else None
            if obj is None and text:
                try:
                    obj = json.loads(text)
                except ValueError:
                    obj = None
            body = error_from(resp.status_code, obj, text)
        elif isinstance(call.response_obj, dict):
            try:
                body = to_message(call.response_obj, call.model, _stops(call))
            except AnswerError as exc:  # vLLM's own /v1/messages fails such an answer too
                json_answer(flow, exc.status, dumps(error_body(exc.status, f"lightning-proxy: {exc}")))
                return
        else:
            return  # not JSON (capture recorded it as malformed): relayed as it came
        resp.headers.pop("Content-Encoding", None)  # first: setting .content encodes by this header
        resp.headers["Content-Type"] = "application/json"
        resp.content = dumps(body)
