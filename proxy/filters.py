"""Response filters: pure functions from a response object or one stream event to what the harness
gets.

The rewrite addon installs them per call (``Call.event_filters``); the SSE relay applies them to
every event and the rewrite addon to a whole JSON body. A filter never changes the object it is
given: it returns a copy of what it changes (the rest shared), or the object itself when nothing
changes. So the relay parses a streamed event once and hands that same object to the span's
assembler after the harness's copy has gone out (in-place filters made it parse every event twice).
No mitmproxy here, so they are tested alone.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from . import tokenchunk
from .fastjson import dumps_bytes
from .sse import emptied, emptied_bytes


def _with(obj: dict, key: str, value: Any) -> dict:
    """``obj`` with ``key`` set to ``value``: ``obj`` itself if it already is, else a shallow copy."""
    if key in obj and obj[key] is value:
        return obj
    out = dict(obj)
    out[key] = value
    return out


def _without(obj: dict, keys: tuple[str, ...]) -> dict:
    """``obj`` without ``keys``: ``obj`` itself if it has none of them, else a shallow copy."""
    out = obj
    for k in keys:
        if k in out:
            if out is obj:
                out = dict(obj)
            del out[k]
    return out


def _dropped(obj: dict, keys: tuple[str, ...], as_null: bool) -> dict:
    """``obj`` without ``keys`` (``as_null``: with each present one set to null, as an answer whose
    request did not ask for it says it: vLLM 0.32 writes such a field as null where it writes it at
    all, in a JSON answer and in a stream's chunks; a hosted API's answers have no such keys)."""
    if not as_null:
        return _without(obj, keys)
    for k in keys:
        if obj.get(k) is not None:
            obj = _with(obj, k, None)
    return obj


def _mapped(items: list, fn: Callable[[Any], Any]) -> list:
    """``fn`` of each item: ``items`` itself if no item changed, else a new list."""
    out = None
    for i, item in enumerate(items):
        new = fn(item)
        if new is not item:
            if out is None:
                out = list(items)
            out[i] = new
    return items if out is None else out


def make_stripper(token_ids: bool, logprobs: bool, as_null: bool = False):
    """A function returning a completion object or chunk without the injected fields (it runs for
    every streamed token: plain loops in the helpers above, no generator); ``as_null``: each one
    present set to null, as plain vLLM writes a field not asked for (:func:`_dropped`), except in a
    chunk the relay then drops (:func:`_held_back`). When both were injected, its ``cut`` attribute
    strips a vLLM chat chunk's bytes without parsing them (:func:`cut_chat_chunk`)."""
    dropped = ("token_ids", "prompt_token_ids") if token_ids else ()

    def strip_choice(ch: Any) -> Any:
        if not isinstance(ch, dict):
            return ch
        out = _dropped(ch, dropped, as_null)
        if logprobs and out.get("logprobs") is not None:
            if out is ch:
                out = dict(ch)
            out["logprobs"] = None  # (not _with: one copy of the choice, not two, per token)
        return out

    def strip(obj: dict) -> dict:
        if token_ids:
            obj = _dropped(obj, ("prompt_token_ids",), as_null)
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return obj
        out = _with(obj, "choices", _mapped(choices, strip_choice))
        return _held_back(obj, out) if as_null and token_ids and out is not obj else out

    if token_ids and logprobs:
        strip.cut = functools.partial(cut_chat_chunk, as_null=True) if as_null else cut_chat_chunk
        strip.token_edit = functools.partial(_strip_token_chunk, b',"token_ids":null' if as_null else b"")
    else:
        strip.cut = strip.token_edit = None
    return strip


def _strip_token_chunk(ids: bytes, pieces: list[bytes]) -> None:
    """``strip`` of a matched token chunk (``tokenchunk.parts``, edited in place): logprobs null, token
    ids as ``ids`` (null, or gone). It has text, so the relay never drops it (``sse.emptied``)."""
    pieces[tokenchunk.LOGPROBS] = b"null"
    pieces[tokenchunk.TOKEN_IDS] = ids


def _held_back(sent: dict, out: dict) -> dict:
    """``out`` (``sent`` stripped, its token ids set to null), or, when it is a chat chunk left with
    nothing for the harness, the same without its choices' ``token_ids``: the relay drops such a chunk
    (``sse.emptied``: only one whose members it all knows), as vLLM sends none for a token that
    makes no delta unless token ids or logprobs are asked for."""
    if out.get("object") != "chat.completion.chunk" or any(
            type(c) is dict and c.get("delta") for c in out["choices"]):
        return out
    bare = _with(out, "choices", _mapped(out["choices"], lambda c: _without(c, ("token_ids",))
                                         if isinstance(c, dict) else c))
    return bare if emptied(sent, bare) else out


# The bytes of one vLLM chat chunk (pydantic's compact JSON, its field order) as it streams a token:
#   {"id":..,"object":"chat.completion.chunk",..,"choices":[{"index":0,"delta":{..},
#    "logprobs":{..}|null,"finish_reason":..,"stop_reason":..,"token_ids":[..]}]}
_CHAT_CHUNK = b'"object":"chat.completion.chunk"'
_CHOICES = b',"choices":[{"index":'
_TOKEN_IDS = b',"token_ids":['
_LOGPROBS = b',"logprobs":'
_FINISH, _STOP = b'},"finish_reason":', b'},"stop_reason":'
_PROMPT_IDS_KEY = b'"prompt_token_ids"'
_TAIL = re.compile(rb'(?:,"finish_reason":(?:null|"[A-Za-z_]*"))?(?:,"stop_reason":(?:null|-?\d+|"(?:[^"\\]|\\.)*"))?')
_NEXT_MEMBER = re.compile(rb'}[ \t\r\n]*,[ \t\r\n]*"')  # an object's end, then another member


def _chat_choices_at(payload: bytes) -> int:
    """Where a vLLM chat chunk's ``,"choices":[{"index":`` starts (after its id, object, created and
    model), or -1 when the payload is not one."""
    c = payload.find(_CHOICES, 0, 400)
    return c if c >= 0 and payload.find(_CHAT_CHUNK, 0, c) >= 0 else -1


def _members_after(payload: bytes, start: int, k: int) -> int:
    """Where the choice's members after the value at ``start`` begin (finish_reason, else stop_reason,
    else token_ids at ``k``): just after the ``}`` that ends that value."""
    end = payload.find(_FINISH, start, k)
    if end < 0:
        end = payload.find(_STOP, start, k)
    return end + 1 if end >= 0 else k


def cut_chat_chunk(payload: bytes, as_null: bool = False) -> bytes | None:
    """A chat chunk without ``token_ids`` (``as_null``: with ``"token_ids":null``, as plain vLLM
    writes it, unless the chunk is one the relay drops) and with ``"logprobs":null``, cut out of its
    bytes; None when it is not the usual token chunk (the caller then parses and strips it).

    Why this is right without parsing: in JSON text every ``"`` inside a string is escaped, so
    a comma or brace, a quoted key and a colon in a row occur only as structure, never inside
    the model's text, whatever it wrote. In a chat chunk the keys looked for are the choice's;
    one ``"index":`` means one choice and no tool-call delta. So ``token_ids`` is the choice's last
    member when the chunk ends ``[digits]}]}``, and ``logprobs``'s value (an object) runs to the
    ``}`` before the member after it; had another member come between, the cut would hold ``},"``,
    which no logprobs object of a chat chunk holds (a token of that text only costs the fast
    path, whose check then fails: such runs are looked for). What follows logprobs up to
    ``token_ids`` must be vLLM's ``finish_reason`` and ``stop_reason`` exactly as it spells them
    (``_TAIL``), so a key of the same name nested elsewhere (a fuzzer's find) cannot end the cut.
    The result is the JSON value the parsing stripper returns, in upstream's spelling. Whether the
    chunk is valid JSON at all is decided when the relay parses the held bytes for the span (a
    malformed event is reported there, as on the parsing path). Every step is a C-level scan (~2.5 us a chunk): parsing,
    stripping and re-serialising each event cost a tenth of the proxy's CPU on a streamed answer.
    """
    if not payload.endswith(b"]}]}") or _PROMPT_IDS_KEY in payload:
        return None
    k = payload.rfind(_TOKEN_IDS)
    ids = payload[k + len(_TOKEN_IDS):-4]
    if k < 0 or not ids.isdigit() and (ids.translate(None, b"0123456789,") or ids[:1] == b","
                                       or ids[-1:] == b"," or b",," in ids):
        return None  # token_ids is not the last member, or not a plain list of integers
    c = _chat_choices_at(payload)
    if c < 0 or payload.find(b'"index":', c + len(_CHOICES)) >= 0:
        return None
    i = payload.find(_LOGPROBS, c, k)
    if i >= 0 and payload[i - 1] != 125:  # not right after the delta object's }: not the choice's
        return None
    start = i + len(_LOGPROBS)
    if i < 0 or payload.startswith(b"null", start):  # no logprobs value to drop: only token_ids goes,
        end = _members_after(payload, c, k) if i < 0 else start + 4  # if it is the choice's (_TAIL)
        return _ids_end(payload[:k], as_null) if _TAIL.fullmatch(payload, end, k) else None
    end = _members_after(payload, start, k)
    if payload[start] != 123 or payload[end - 1] != 125 or _NEXT_MEMBER.search(payload, start, end) \
            or not _TAIL.fullmatch(payload, end, k):
        return None  # ({ and }; after logprobs, only finish_reason and stop_reason, spelled as vLLM does)
    return _ids_end(payload[:start] + b"null" + payload[end:k], as_null)


_END, _NULL_IDS_END = b"}]}", b',"token_ids":null}]}'


def _ids_end(head: bytes, as_null: bool) -> bytes:
    """The chunk whose ``token_ids`` was cut away, up to the end of its choice's members before it
    (``head``), closed; ``as_null``: with ``"token_ids":null`` as plain vLLM ends a chunk's choice,
    unless the relay drops the chunk (left with nothing, ``sse.emptied_bytes``: vLLM sends none for
    such a token; its delta is ``{}``, looked for first)."""
    if as_null and (b'"delta":{}' not in head or not emptied_bytes(head + _END)):
        return head + _NULL_IDS_END
    return head + _END


def make_responses_stripper(token_ids: bool, logprobs: bool, as_null: bool = False):
    """The same for Responses API objects and stream events (whose ``response`` is the object).
    Without the logprobs ``include``, vLLM says ``top_logprobs: null`` in the response object,
    ``logprobs: null`` in an output text part (the response's, a ``.done`` event's) and ``[]`` in a
    stream event's own ``logprobs`` (``output_text.delta``/``.done``): each gets back what it would
    have said."""

    def strip_part(part: Any) -> Any:
        return _with(part, "logprobs", None) if isinstance(part, dict) and part.get("logprobs") else part

    def strip_item(item: Any) -> Any:
        if not isinstance(item, dict) or not isinstance(item.get("content"), list):
            return item
        return _with(item, "content", _mapped(item["content"], strip_part))

    def strip_response(resp: dict) -> dict:
        if token_ids:
            resp = _dropped(resp, ("input_messages", "output_messages"), as_null)
        if not logprobs:
            return resp
        if resp.get("top_logprobs") is not None and resp.get("object") == "response":
            resp = _with(resp, "top_logprobs", None)
        output = resp.get("output")
        return _with(resp, "output", _mapped(output, strip_item)) if isinstance(output, list) else resp

    def strip(obj: dict) -> dict:
        obj = strip_response(obj)
        if isinstance(obj.get("response"), dict):
            obj = _with(obj, "response", strip_response(obj["response"]))
        if logprobs:
            if obj.get("logprobs"):  # response.output_text.delta / .done
                obj = _with(obj, "logprobs", [])
            if isinstance(obj.get("part"), dict):  # response.content_part.added / .done
                obj = _with(obj, "part", strip_part(obj["part"]))
            if isinstance(obj.get("item"), dict):  # response.output_item.added / .done
                obj = _with(obj, "item", strip_item(obj["item"]))
        return obj

    return strip


def make_model_restorer(asked: str):
    """A function that puts the model name the harness asked for back into a response or chunk
    (Responses stream events carry it in their ``response``); its ``cut`` does it to a vLLM chat
    chunk's bytes (:func:`cut_chunk_model`)."""

    def restore(obj: dict) -> dict:
        if "model" in obj:
            obj = _with(obj, "model", asked)
        if isinstance(obj.get("response"), dict) and "model" in obj["response"]:
            obj = _with(obj, "response", _with(obj["response"], "model", asked))
        return obj

    value = dumps_bytes(asked)  # (UTF-8 whatever the name holds: escapes where it has no UTF-8 form)
    restore.cut = lambda payload: cut_chunk_model(payload, value)
    restore.token_edit = functools.partial(_restore_token_chunk, value)
    return restore


def _restore_token_chunk(value: bytes, pieces: list[bytes]) -> None:
    """``restore`` of a matched token chunk (``tokenchunk.parts``, edited in place)."""
    pieces[tokenchunk.MODEL] = value


_MODEL = b',"model":"'


def cut_chunk_model(payload: bytes, value: bytes) -> bytes | None:
    """A chat chunk whose top-level ``model`` is the JSON string ``value``, as bytes; None when it is
    not a vLLM chat chunk with only scalars before its choices (then the chunk is parsed).

    Before ``"choices"`` a vLLM chat chunk holds only ``id``, ``object``, ``created`` and ``model``:
    with no ``{`` or ``[`` there, the ``,"model":"`` found is the top-level one (such bytes are
    structure, see :func:`cut_chat_chunk`), and its string ends at the next ``"`` when no
    backslash comes before it."""
    c = _chat_choices_at(payload)
    if c < 0 or payload.find(b"{", 1, c) >= 0 or payload.find(b"[", 0, c) >= 0:
        return None
    m = payload.find(_MODEL, 0, c)
    start = m + len(_MODEL) - 1  # the opening quote
    end = payload.find(b'"', start + 1, c) + 1
    if m < 0 or end <= 0 or payload.find(b"\\", start, end) >= 0 or payload.find(_MODEL, end, c) >= 0:
        return None
    return payload[:start] + value + payload[end:]
