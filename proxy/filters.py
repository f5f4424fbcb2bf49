"""Response filters: pure functions that rewrite a response object or one stream event in place.

The rewrite addon installs them per call (``Call.event_filters``); the SSE relay applies them to
every event and the rewrite addon to a whole JSON body. No mitmproxy here, so they are tested alone.
"""

from __future__ import annotations


def make_stripper(token_ids: bool, logprobs: bool):
    """A function that removes injected fields from a completion object or chunk, in place."""

    def strip(obj: dict) -> None:
        if token_ids:
            obj.pop("prompt_token_ids", None)
        for ch in obj.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            if token_ids:
                ch.pop("token_ids", None)
                ch.pop("prompt_token_ids", None)
            if logprobs and "logprobs" in ch:
                ch["logprobs"] = None

    return strip


def make_responses_stripper(token_ids: bool, logprobs: bool):
    """The same for Responses API objects and stream events (whose ``response`` is the object)."""

    def strip_parts(parts) -> None:
        for part in parts if isinstance(parts, list) else ():
            if isinstance(part, dict) and part.get("logprobs"):
                part["logprobs"] = []

    def strip_response(resp: dict) -> None:
        if token_ids:
            resp.pop("input_messages", None)
            resp.pop("output_messages", None)
        if logprobs:
            for item in resp.get("output") or ():
                if isinstance(item, dict):
                    strip_parts(item.get("content"))

    def strip(obj: dict) -> None:
        strip_response(obj)
        if isinstance(obj.get("response"), dict):
            strip_response(obj["response"])
        if logprobs:
            if obj.get("logprobs"):  # response.output_text.delta / .done
                obj["logprobs"] = []
            if isinstance(obj.get("part"), dict):  # response.content_part.added / .done
                strip_parts([obj["part"]])
            if isinstance(obj.get("item"), dict):  # response.output_item.added / .done
                strip_parts(obj["item"].get("content"))

    return strip


def make_model_restorer(asked: str):
    """A function that puts the model name the harness asked for back into a response or chunk
    (Responses stream events carry it in their ``response``)."""

    def restore(obj: dict) -> None:
        if "model" in obj:
            obj["model"] = asked
        if isinstance(obj.get("response"), dict) and "model" in obj["response"]:
            obj["response"]["model"] = asked

    return restore
