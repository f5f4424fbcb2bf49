"""Ask the training upstream for token ids and logprobs; hide them from a harness that did not ask.

For calls routed to the training pool (and when injection is on for that replica), add
``return_token_ids`` and ``logprobs`` to requests that lack them (Responses API:
``enable_response_messages`` and ``include: [message.output_text.logprobs]``), map the model name
(``model_map``, then ``served_model``), and strip from the response (JSON or each SSE event)
exactly what was injected, so the harness sees what it expects. A mapped model name is mapped
back in the response (``model`` of the body or of every chunk): a harness that asked for
``gpt-4o`` gets ``gpt-4o`` back (some check it, some key caches and cost tables on it).
Runs after capture: the span keeps the request as sent and the response with its token ids.

A Responses answer the engine stores (``store``, its default) is handed out again, as the engine
made it (with what the proxy asked for), by ``GET .../responses/{id}`` (JSON, or the events of a
``background`` stream with ``?stream=true``) and ``POST .../responses/{id}/cancel``. Those answers
are cut as the call that made it was, by what its harness asked: the proxy remembers that per
response id (:class:`StoredAnswers`, the newest ``STORED_IDS``). An id it does not know (made
through another proxy process, or before a restart) loses what the proxy injects by default: a
harness that asked for token ids or logprobs itself is the rarer one.

A stored answer belongs to the rollout whose call made it (several rollouts share one proxy, and
each harness runs what the policy writes). Another rollout's read, cancel or delete of its id gets
the engine's 404 for an unknown id from the proxy, and its create naming it (``previous_response_id``:
that conversation would enter this rollout's call; ``request_id``, which vLLM lets a caller pick: it
would overwrite the stored answer) is refused with 404 or 400 and recorded as an error span; nothing
of either is forwarded. An id the proxy does not know is forwarded as before.
"""

from __future__ import annotations

import collections
import hashlib
import logging

from mitmproxy import http

from .. import fastjson
from ..assemble import CHAT, COMPLETIONS, LOGPROBS_INCLUDE, RESPONSES
from ..credentials import log_safe
from ..filters import make_model_restorer, make_responses_stripper, make_stripper
from ..lax import engine_flag, engine_int, reads_as_bool
from ..sse import SSERelay
from ..state import META, MODEL, OTHER, Call, ProxyState, keep_newest
from .answers import json_answer, rewrite_failed
from .routing import response_action

log = logging.getLogger("lightning.proxy")
STORED = "lh.stored"  # flow.metadata key: what a Responses call's stored answer must lose (StoredAnswers)
# response ids remembered; measured (tracemalloc): 53 MiB with 256-character model names, 90 MiB at most
# (128-character ids, 256-character names, a distinct 255-character owner each); 17 MiB with neither
STORED_IDS = 100_000
# what a request must hold for the engine to read it at all: without it, its error echoes the body's
# size ("'input': '<dict of 1 items>'"), which counts injected fields
_REQUIRED = {CHAT: "messages", RESPONSES: "input"}
_FLAGS = {CHAT: ("return_token_ids", "logprobs"), COMPLETIONS: ("return_token_ids",),
          RESPONSES: ("enable_response_messages",)}  # the booleans the proxy may write over


def _changes_the_answer(endpoint: str | None, obj: dict) -> bool:
    """Whether injecting would change what the harness gets beyond the fields stripped again: vLLM
    blanks the echoed prompt of a completions call with ``echo`` once token ids are asked for (the
    harness read "111" for "1+1=111"), and a call plain vLLM refuses (400) for asking logprobs' details
    without ``logprobs`` would succeed once ``logprobs`` is injected (chat: ``top_logprobs`` above 0
    or -1, or ``logprob_token_ids``; completions: ``logprob_token_ids``), read as vLLM 0.32's checks
    read them. Such a call goes upstream as sent; the trainer rebuilds its token ids from the text.
    ``top_logprobs: 0`` or ``logprob_token_ids: []`` the engine serves either way: injected."""
    if endpoint == CHAT:
        top = obj.get("top_logprobs")
        details = bool(obj.get("logprob_token_ids")) or (type(top) in (int, float, bool) and (top == -1 or top > 0))
        return details and not obj.get("logprobs")
    if endpoint == COMPLETIONS and obj.get("logprobs") is None and (
            obj.get("logprob_token_ids") or (obj.get("use_beam_search") and obj.get("echo"))):
        return True  # (beam search with a raw echo: vLLM refuses any logprobs, "false" as much as true)
    return endpoint != RESPONSES and engine_flag(obj.get("echo"))


def _injectable(endpoint: str | None, obj: dict) -> bool:
    """Whether the proxy may add its fields: not where that changes the answer beyond what is stripped
    again (:func:`_changes_the_answer`), nor in a request the engine refuses anyway, for a value the
    proxy would write over (``logprobs: "maybe"``, an ``include`` that is no list: written over, the
    call was served) or for a missing ``messages``/``input``. Such a call goes upstream as sent, and
    the engine refuses it as it would without the proxy."""
    if _changes_the_answer(endpoint, obj) or (endpoint in _REQUIRED and _REQUIRED[endpoint] not in obj):
        return False
    if endpoint == RESPONSES and not isinstance(obj.get("include"), list | None):
        return False
    if endpoint == RESPONSES and "enable_response_messages" in obj and obj["enable_response_messages"] is None:
        return False  # (a bool there, not optional: null is refused)
    return all(reads_as_bool(obj.get(k)) for k in _FLAGS.get(endpoint, ()))


def _inject_responses(call: Call, obj: dict) -> bool:
    """``enable_response_messages`` and the logprobs ``include`` where the harness did not ask."""
    changed = False
    if not engine_flag(obj.get("enable_response_messages")):
        obj["enable_response_messages"] = True
        call.injected_token_ids = changed = True
    include = obj.get("include") or []
    if LOGPROBS_INCLUDE not in include:
        obj["include"] = [*include, LOGPROBS_INCLUDE]
        call.injected_logprobs = changed = True
        if obj.get("top_logprobs") not in (None, 0) and engine_int(obj["top_logprobs"]) is not None:
            obj["top_logprobs"] = 0  # (see _inject_tokens)
    return changed


def _inject_tokens(call: Call, obj: dict) -> bool:
    """``return_token_ids`` and ``logprobs`` (chat: true; completions: 0, only the sampled token's).

    Logprobs the harness did not ask for are the sampled token's only: its ``top_logprobs``, which the
    engine ignored without them, goes upstream as 0, as the engine checks it against its limit once
    they are asked for (25 was refused, -1 asked for the vocabulary); a value the engine refuses
    anyway (chat's raw check takes a number, positive or -1) stays, and the engine refuses the call."""
    changed = False
    if not engine_flag(obj.get("return_token_ids")):
        obj["return_token_ids"] = True
        call.injected_token_ids = changed = True
    if call.endpoint == CHAT:
        if not engine_flag(obj.get("logprobs")):
            obj["logprobs"] = True
            call.injected_logprobs = changed = True
            top = obj.get("top_logprobs")
            if type(top) in (int, float, bool) and (top > 0 or top == -1) and engine_int(top) is not None:
                obj["top_logprobs"] = 0
    elif obj.get("logprobs") is None:
        obj["logprobs"] = 0
        call.injected_logprobs = changed = True
    return changed


class StoredAnswers:
    """Per stored Responses answer (its id), what the call that made it injected and whose it is, as
    ``(token_ids, logprobs, the model name the harness asked for or None, owner)``: the newest
    ``limit`` ids. The owner is that call's rollout id (None where the proxy runs without rollout
    identities: no ownership then). Memory stays bounded whatever a harness sends: a model name longer
    than ``MAX_NAME`` is not kept (not mapped back in a stored read), an id longer than ``MAX_ID`` (a
    harness may pick its own, vLLM's ``request_id``) is kept as its SHA-256 digest, and owners are
    rollout ids the proxy validated (at most 255 characters)."""

    MAX_NAME = 256
    MAX_ID = 128

    def __init__(self, limit: int = STORED_IDS) -> None:
        self.limit = limit
        self.ids: collections.OrderedDict[str | bytes, tuple] = collections.OrderedDict()

    @classmethod
    def _key(cls, response_id: str) -> str | bytes:
        if len(response_id) <= cls.MAX_ID:
            return response_id
        return hashlib.sha256(response_id.encode("utf-8", "surrogatepass")).digest()

    def put(self, response_id: str, entry: tuple) -> None:
        if isinstance(entry[2], str) and len(entry[2]) > self.MAX_NAME:
            entry = (*entry[:2], None, *entry[3:])
        keep_newest(self.ids, self._key(response_id), entry, self.limit)

    def get(self, response_id: str) -> tuple | None:
        return self.ids.get(self._key(response_id))

    def foreign(self, response_id: object, rollout_id: str | None) -> bool:
        """Whether ``response_id`` is remembered as made by a rollout other than ``rollout_id``."""
        entry = self.get(response_id) if isinstance(response_id, str) else None
        return entry is not None and entry[3] is not None and entry[3] != rollout_id

    def remembering(self, entry: tuple):
        """A stream filter that remembers ``entry`` for the response its first events name
        (``response.created``): a ``background`` stream's stored events may be read while it runs."""
        seen = False

        def remember(obj: dict) -> dict:
            nonlocal seen
            resp = obj.get("response")
            if not seen and isinstance(resp, dict) and isinstance(resp.get("id"), str):
                self.put(resp["id"], entry)
                seen = True
            return obj

        return remember


def _not_found(response_id: str) -> dict:
    """vLLM 0.32's answer (404) for a response id it does not hold (``_make_not_found_error``)."""
    return {"error": {"message": f"Response with id '{response_id}' not found.", "type": "invalid_request_error",
                      "param": "response_id", "code": 404}}


# vLLM 0.32's answer (405, ``allow: GET``) to DELETE /v1/responses/{id}, whatever the id: it has no such route.
# A foreign id answered 404 told a harness which ids another rollout holds (every other id gets this).
_NOT_ALLOWED = {"detail": "Method Not Allowed"}


def _ignore(event: dict) -> None:
    """The sink of a relay that only rewrites (a stored answer read again is not recorded)."""


class Rewrite:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.stored = StoredAnswers()

    def request(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.upstream is None:
            return
        if call.kind == OTHER and flow.response is None:
            self._stored_read(flow, call)
        elif call.kind == MODEL and call.in_flight and call.request_obj is not None:
            if call.endpoint == RESPONSES and self._names_foreign(flow, call, call.request_obj):
                return
            try:
                self._model_call(flow, call, call.request_obj)  # (None: malformed, forwarded unchanged)
            except Exception as exc:
                rewrite_failed(flow, call, "rewriting the request", exc)

    def _names_foreign(self, flow: http.HTTPFlow, call: Call, obj: dict) -> bool:
        """Refuse a Responses create naming another rollout's stored answer (True if refused):
        ``previous_response_id`` would put that conversation into this rollout's call (404, what the
        engine answers for an id it lacks), ``request_id`` would overwrite that answer in the engine's
        store and here (400). Like the proxy's other refusals of a model call it is not forwarded and
        capture records it as an error span (``malformed_request``), never trained on."""
        prev, rid = obj.get("previous_response_id"), obj.get("request_id")
        if self.stored.foreign(prev, call.rollout_id):
            status, body, why = 404, _not_found(prev), "previous_response_id names"
        elif self.stored.foreign(rid, call.rollout_id):
            why = "request_id names"
            body = {"error": {"message": f"lightning-proxy: {why} a stored response of another rollout; choose "
                              "another (or leave it out: the engine picks a random one)",
                              "type": "invalid_request_error", "param": "request_id", "code": 400}}
            status = 400
        else:
            return False
        call.request_error = f"lightning-proxy: {why} a stored response of another rollout; answered here, not sent"
        self._refuse(flow, status, body, why)
        return True

    def _refuse(self, flow: http.HTTPFlow, status: int, body: dict, why: str, headers: dict | None = None) -> None:
        """Answer now, nothing forwarded; compact JSON as vLLM writes its errors (the 404 is its own)."""
        self.state.rejected += 1
        json_answer(flow, status, fastjson.dumps_bytes(body), headers)
        log.info("refused %s %s (%s): %s another rollout's stored response", log_safe(flow.request.method, 20),
                 log_safe(flow.request.path.split("?", 1)[0]), status, why)

    def _model_call(self, flow: http.HTTPFlow, call: Call, obj: dict) -> None:
        model = obj.get("model")
        changed = self._map_model(call, obj)
        if call.inject and _injectable(call.endpoint, obj):
            changed = (_inject_responses if call.endpoint == RESPONSES else _inject_tokens)(call, obj) or changed
        if changed:
            # the harness's own numbers (NaN, huge integers) go upstream exactly
            flow.request.content = fastjson.dumps_exact(obj, call.request_fast)
        asked = model if isinstance(model, str) and obj.get("model") != model else None
        if call.injected_token_ids or call.injected_logprobs:
            make = make_responses_stripper if call.endpoint == RESPONSES else make_stripper
            # what the harness would have had from what it addressed: vLLM writes a field not asked for
            # as null (JSON answers, Responses objects, chat and completions chunks); a hosted API has none
            call.event_filters.append(make(call.injected_token_ids, call.injected_logprobs, not call.hosted))
        if asked is not None:
            call.event_filters.append(make_model_restorer(asked))
        store = obj.get("store", True)  # (its owner: even uninjected; not where the engine refuses the flag)
        if call.endpoint == RESPONSES and engine_flag(store) and reads_as_bool(store):
            entry = (call.injected_token_ids, call.injected_logprobs, asked, call.rollout_id)
            flow.metadata[STORED] = entry
            if call.event_filters:  # (a stream rewritten anyway; the JSON answer's id: response)
                call.event_filters.append(self.stored.remembering(entry))
            if isinstance(obj.get("request_id"), str):  # the answer's id, chosen by the harness: owned now,
                self.stored.put(obj["request_id"], entry)  # not once an answer it may hang up on comes back

    def _map_model(self, call: Call, obj: dict) -> bool:
        """``model`` as the pool serves it (``model_map``, then ``served_model``); whether it changed."""
        cfg = self.state.config
        model = obj.get("model")
        served = cfg.model_map.get(model) if isinstance(model, str) else None
        served = served or cfg.served_model or model
        call.served_model = served if isinstance(served, str) else None
        if served == model:
            return False
        obj["model"] = served
        return True

    def _stored_read(self, flow: http.HTTPFlow, call: Call) -> None:
        """A stored Responses answer read from the pool (``GET``, ``cancel``): cut as the call that
        made it was (see the module's docstring)."""
        action = response_action(flow.request.method, call.path or flow.request.path)  # (the harness's path)
        if action is not None and self.stored.foreign(action[0], call.rollout_id):
            if action[1] == "delete":  # what the engine answers a DELETE of any id, its own or none
                self._refuse(flow, 405, _NOT_ALLOWED, "delete of", {"allow": "GET"})
            else:
                self._refuse(flow, 404, _not_found(action[0]), f"{action[1]} of")  # (as if it did not exist)
            return
        if action is None or action[1] not in ("read", "cancel") or not call.inject:
            return
        token_ids, logprobs, asked, _ = self.stored.get(action[0]) or (True, True, None, None)
        if token_ids or logprobs:
            call.event_filters.append(make_responses_stripper(token_ids, logprobs, not call.hosted))
        if asked is not None:
            call.event_filters.append(make_model_restorer(asked))
        if call.event_filters:  # rewritten: plain bytes (what vLLM sends anyway)
            flow.request.headers["Accept-Encoding"] = "identity"

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """A stored answer's events are cut as they pass; its JSON is held whole to be cut (the limits
        addon streams large answers to other traffic)."""
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind != OTHER or not call.event_filters or flow.response is None:
            return
        if "text/event-stream" in flow.response.headers.get("Content-Type", ""):
            flow.response.stream = SSERelay(_ignore, call.event_filters, max_event=self.state.config.max_decoded_size)
            flow.response.headers.pop("Content-Length", None)
        else:
            flow.response.stream = False

    def response(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None:
            return
        obj = call.response_obj
        entry = flow.metadata.get(STORED)
        if entry is not None and isinstance(obj, dict) and isinstance(obj.get("id"), str):
            self.stored.put(obj["id"], entry)
        if call.sse is not None or not call.event_filters:
            return
        if call.kind == OTHER:
            self._cut_stored(flow.response, call)
            return
        if not isinstance(obj, dict):
            return
        for f in call.event_filters:
            obj = f(obj)
        flow.response.content = fastjson.dumps_bytes(obj)

    @staticmethod
    def _cut_stored(resp: http.Response, call: Call) -> None:
        """A stored answer's JSON, cut; its bytes as they came where nothing is cut (an error)."""
        if resp.stream or not resp.raw_content:
            return
        try:
            obj = fastjson.loads(resp.content)
        except (ValueError, RecursionError):
            return
        new = obj
        for f in call.event_filters if isinstance(obj, dict) else ():
            new = f(new)
        if new is not obj:
            resp.content = fastjson.dumps_bytes(new)
