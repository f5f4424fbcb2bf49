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

from collections.abc import Callable
from typing import Any


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


def make_stripper(token_ids: bool, logprobs: bool):
    """A function returning a completion object or chunk without the injected fields (it runs for
    every streamed token: plain loops in the helpers above, no generator)."""
    dropped = ("token_ids", "prompt_token_ids") if token_ids else ()

    def strip_choice(ch: Any) -> Any:
        if not isinstance(ch, dict):
            return ch
        out = _without(ch, dropped)
        if logprobs and out.get("logprobs") is not None:
            if out is ch:
                out = dict(ch)
            out["logprobs"] = None  # (not _with: one copy of the choice, not two, per token)
        return out

    def strip(obj: dict) -> dict:
        if token_ids:
            obj = _without(obj, ("prompt_token_ids",))
        choices = obj.get("choices")
        return _with(obj, "choices", _mapped(choices, strip_choice)) if isinstance(choices, list) else obj

    return strip


def make_responses_stripper(token_ids: bool, logprobs: bool):
    """The same for Responses API objects and stream events (whose ``response`` is the object)."""

    def strip_part(part: Any) -> Any:
        return _with(part, "logprobs", []) if isinstance(part, dict) and part.get("logprobs") else part

    def strip_parts(parts: Any) -> Any:
        return _mapped(parts, strip_part) if isinstance(parts, list) else parts

    def strip_item(item: Any) -> Any:
        if not isinstance(item, dict) or "content" not in item:
            return item
        return _with(item, "content", strip_parts(item["content"]))

    def strip_response(resp: dict) -> dict:
        if token_ids:
            resp = _without(resp, ("input_messages", "output_messages"))
        output = resp.get("output")
        if logprobs and isinstance(output, list):
            resp = _with(resp, "output", _mapped(output, strip_item))
        return resp

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
    (Responses stream events carry it in their ``response``)."""

    def restore(obj: dict) -> dict:
        if "model" in obj:
            obj = _with(obj, "model", asked)
        if isinstance(obj.get("response"), dict) and "model" in obj["response"]:
            obj = _with(obj, "response", _with(obj["response"], "model", asked))
        return obj

    return restore
