"""Ask the training upstream for token ids and logprobs; hide them from a harness that did not ask.

For calls routed to the training pool (and when injection is on for that replica), add
``return_token_ids`` and ``logprobs`` to requests that lack them (Responses API:
``enable_response_messages`` and ``include: [message.output_text.logprobs]``), map the model name
(``model_map``, then ``served_model``), and strip from the response (JSON or each SSE event)
exactly what was injected, so the harness sees what it expects. A mapped model name is mapped
back in the response (``model`` of the body or of every chunk): a harness that asked for
``gpt-4o`` gets ``gpt-4o`` back (some check it, some key caches and cost tables on it).
Runs after capture: the span keeps the request as sent and the response with its token ids.
"""

from __future__ import annotations

from mitmproxy import http

from .. import fastjson
from ..assemble import CHAT, LOGPROBS_INCLUDE, RESPONSES, engine_flag
from ..filters import make_model_restorer, make_responses_stripper, make_stripper
from ..state import META, MODEL, Call, ProxyState


def _changes_the_answer(endpoint: str | None, obj: dict) -> bool:
    """Whether injecting would change what the harness gets beyond the fields stripped again: vLLM
    blanks the echoed prompt of a completions call with ``echo`` once token ids are asked for (the
    harness read "111" for "1+1=111"), and a chat call with ``top_logprobs`` but no ``logprobs``,
    which plain vLLM refuses (400), would succeed. Such a call goes upstream as sent; the trainer
    rebuilds its token ids from the text."""
    if endpoint == CHAT:
        asks = ("top_logprobs", "logprob_token_ids")
        return not engine_flag(obj.get("logprobs")) and any(obj.get(k) is not None for k in asks)
    return endpoint != RESPONSES and engine_flag(obj.get("echo"))


class Rewrite:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def request(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind != MODEL or not call.in_flight or call.upstream is None:
            return
        obj = call.request_obj
        if obj is None:
            return  # malformed: forwarded unchanged, capture records the error
        cfg = self.state.config
        changed = False
        model = obj.get("model")
        served = cfg.model_map.get(model) if isinstance(model, str) else None
        served = served or cfg.served_model or model
        if served != model:
            obj["model"] = served
            changed = True
        call.served_model = served if isinstance(served, str) else None
        if call.inject and call.endpoint == RESPONSES:
            if not engine_flag(obj.get("enable_response_messages")):
                obj["enable_response_messages"] = True
                call.injected_token_ids = changed = True
            include = obj.get("include") if isinstance(obj.get("include"), list) else []
            if LOGPROBS_INCLUDE not in include:
                obj["include"] = [*include, LOGPROBS_INCLUDE]
                call.injected_logprobs = changed = True
        elif call.inject and not _changes_the_answer(call.endpoint, obj):
            if not engine_flag(obj.get("return_token_ids")):
                obj["return_token_ids"] = True
                call.injected_token_ids = changed = True
            if call.endpoint == CHAT:
                if not engine_flag(obj.get("logprobs")):
                    obj["logprobs"] = True
                    call.injected_logprobs = changed = True
            elif obj.get("logprobs") is None:
                obj["logprobs"] = 0  # completions: 0 = only the sampled token's logprob
                call.injected_logprobs = changed = True
        if changed:
            # the harness's own numbers (NaN, huge integers) go upstream exactly
            flow.request.content = fastjson.dumps_exact(obj, call.request_fast)
        if call.injected_token_ids or call.injected_logprobs:
            make = make_responses_stripper if call.endpoint == RESPONSES else make_stripper
            # the answer the harness would have had from what it addressed: vLLM writes fields not asked
            # for as null in a JSON answer and in a Responses stream's response objects, and leaves them
            # out of chat and completions chunks; a hosted API has no such fields
            as_null = not call.hosted and (call.endpoint == RESPONSES or not engine_flag(obj.get("stream")))
            call.event_filters.append(make(call.injected_token_ids, call.injected_logprobs, as_null))
        if served != model and isinstance(model, str):
            call.event_filters.append(make_model_restorer(model))

    def response(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.sse is not None or not call.event_filters:
            return
        obj = call.response_obj
        if not isinstance(obj, dict):
            return
        for f in call.event_filters:
            obj = f(obj)
        flow.response.content = fastjson.dumps_bytes(obj)
