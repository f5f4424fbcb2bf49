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
    if not any(k in obj for k in keys):
        return obj
    out = dict(obj)
    for k in keys:
        out.pop(k, None)
    return out


def make_stripper(token_ids: bool, logprobs: bool):
    """A function returning a completion object or chunk without the injected fields. It runs for
    every streamed token, so it is written for speed: a copy of the object and of each choice
    that changes, plain loops, no generator."""
    dropped = ("token_ids", "prompt_token_ids") if token_ids else ()

    def strip(obj: dict) -> dict:
        if token_ids and "prompt_token_ids" in obj:
            obj = dict(obj)
            del obj["prompt_token_ids"]
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return obj
        new = None
        for i, ch in enumerate(choices):
            if not isinstance(ch, dict):
                continue
            copy = None
            for key in dropped:
                if key in ch:
                    if copy is None:
                        copy = dict(ch)
                    del copy[key]
            if logprobs and "logprobs" in ch and ch["logprobs"] is not None:
                if copy is None:
                    copy = dict(ch)
                copy["logprobs"] = None
            if copy is not None:
                if new is None:
                    new = list(choices)
                new[i] = copy
        return obj if new is None else {**obj, "choices": new}

    return strip


def make_responses_stripper(token_ids: bool, logprobs: bool):
    """The same for Responses API objects and stream events (whose ``response`` is the object)."""

    def strip_parts(parts: Any) -> Any:
        if not isinstance(parts, list):
            return parts
        new = [_with(p, "logprobs", []) if isinstance(p, dict) and p.get("logprobs") else p for p in parts]
        return new if any(a is not b for a, b in zip(new, parts)) else parts

    def strip_item(item: Any) -> Any:
        if not isinstance(item, dict) or "content" not in item:
            return item
        return _with(item, "content", strip_parts(item["content"]))

    def strip_response(resp: dict) -> dict:
        if token_ids:
            resp = _without(resp, ("input_messages", "output_messages"))
        output = resp.get("output")
        if logprobs and isinstance(output, list) and output:
            new = [strip_item(it) for it in output]
            if any(a is not b for a, b in zip(new, output)):
                resp = _with(resp, "output", new)
        return resp

    def strip(obj: dict) -> dict:
        obj = strip_response(obj)
        if isinstance(obj.get("response"), dict):
            obj = _with(obj, "response", strip_response(obj["response"]))
        if logprobs:
            if obj.get("logprobs"):  # response.output_text.delta / .done
                obj = _with(obj, "logprobs", [])
            if isinstance(obj.get("part"), dict):  # response.content_part.added / .done
                obj = _with(obj, "part", strip_parts([obj["part"]])[0])
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
