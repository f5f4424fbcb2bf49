"""The Anthropic Messages API spoken over a chat-completions upstream: request, answer and events.

vLLM serves ``/v1/messages`` but converts it to a chat completion inside and returns neither token
ids nor logprobs. So a Messages call routed to the training pool is sent upstream as the equivalent
chat-completions request (where the proxy asks for token ids and logprobs as for any chat call),
and the chat answer is turned back into a Messages answer: one JSON ``message``, or the event
stream ``message_start``, ``content_block_start/delta/stop``..., ``message_delta``,
``message_stop``, produced event by event as chunks arrive.

The mapping (one definition, shared by the proxy and by the samples builder, which renders these
calls through the chat template from the recorded Messages request):
- ``system`` (text or text blocks) -> a leading system message (blocks joined with nothing, empty
  ones and Claude Code's ``x-anthropic-billing-header`` block left out, none when nothing is left, as
  vLLM's own ``/v1/messages`` does); a ``system`` turn in ``messages`` (a vLLM extension) -> a system
  message in its place;
- user/assistant blocks -> the message vLLM's ``/v1/messages`` builds: one ``text`` block as the
  content string, several (or an ``image``, as an ``image_url`` part) as the list of parts (empty
  text blocks left out; a turn with no part has no content, a user turn like that is left out);
  ``thinking`` blocks -> ``reasoning`` (joined with nothing; ``redacted_thinking`` left out);
- assistant ``tool_use`` -> ``tool_calls`` (arguments = ``json.dumps(input)``);
- user ``tool_result`` -> ``tool`` messages (before the user's remaining text); the images of a
  result -> a user message of ``image_url`` parts after it;
- a last ``assistant`` message (a prefill) -> ``continue_final_message`` (the answer continues it,
  as on Anthropic's API; vLLM's endpoint answers in a new turn after it);
- ``tools`` -> functions (``input_schema``, required, -> ``parameters``; ``strict``,
  ``defer_loading`` kept); ``tool_choice`` auto/any/tool/none -> auto/required/named/none;
  ``stop_sequences`` -> ``stop``; ``output_config`` ``format`` -> ``response_format`` (JSON schema)
  and ``effort`` -> ``reasoning_effort``; ``thinking`` enabled -> ``thinking_token_budget``,
  disabled -> ``reasoning_effort: "none"``, adaptive -> nothing;
- other fields that are not Messages fields (vLLM extensions sent as extra body) pass through.
A body that breaks the Messages rules gets :class:`MessagesError` (the proxy answers 400 in the
Anthropic error shape), never a guess.

Pure functions over JSON values; no mitmproxy here.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from typing import Any

from .lax import engine_flag, engine_int, reads_as_bool
from .sse import EVENT_END

MESSAGES = "messages"  # the span's endpoint for Anthropic Messages calls

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}
_PASSED = ("temperature", "top_p", "top_k")  # sampling parameters with the same meaning on both APIs
# Messages fields translated above or with no chat equivalent (dropped); any other field (a vLLM
# sampling extension such as ``seed`` or ``allowed_token_ids`` sent as extra body) passes through
_MESSAGES_FIELDS = frozenset({
    "model", "max_tokens", "messages", "system", "stop_sequences", "tools", "tool_choice", "stream", *_PASSED,
    "metadata", "thinking", "service_tier", "container", "mcp_servers", "context_management", "betas",
    "output_config",
})
EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort, as vLLM's /v1/messages takes it
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's first system block (a per-request hash)


class MessagesError(ValueError):
    """A Messages request the proxy cannot translate; the message says which rule it broke."""


class AnswerError(ValueError):
    """A chat answer vLLM's own ``/v1/messages`` cannot turn into a Messages answer either (a tool
    call whose arguments are not JSON): its endpoint fails the call, so the proxy answers as it does
    (``status``: 400, or 500 for arguments nested too deep to decode), never a guessed ``input``.
    The message holds the decoder's, as vLLM's does."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# -- request --------------------------------------------------------------------------------
def _system(value: Any, where: str = "system") -> str:
    """A system value as one string: vLLM's ``/v1/messages`` joins the blocks with nothing and leaves
    out empty ones and the billing header (its chat renderer would drop that line too)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise MessagesError(f"{where}: expected a string or a list of text blocks")
    parts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise MessagesError(f"{where}[{i}]: expected a text block")
        if block["text"] and not block["text"].startswith(BILLING_HEADER):
            parts.append(block["text"])
    return "".join(parts)


def _system_turn(content: Any, where: str) -> list[dict]:
    """A ``system`` turn inside ``messages`` (a vLLM extension, for mid-conversation instructions) as
    a system message in its place, as vLLM's ``/v1/messages`` sends it to a template that takes a
    system message anywhere (the proxy cannot see whether the engine's template does); left out when
    it has no text (or is the billing header)."""
    text = _system(content, f"{where}.content")
    if isinstance(content, str) and text.startswith(BILLING_HEADER):
        text = ""  # (a string turn that is the header is left out whole, as vLLM does)
    return [{"role": "system", "content": text}] if text else []


def _image_part(block: dict, where: str) -> dict:
    src = block.get("source")
    if isinstance(src, dict) and src.get("type") == "base64" and isinstance(src.get("data"), str):
        url = f"data:{src.get('media_type') or 'image/png'};base64,{src['data']}"
    elif isinstance(src, dict) and src.get("type") == "url" and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise MessagesError(f"{where}: image source must be base64 data or a url")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_call(block: dict, where: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise MessagesError(f"{where}: tool_use needs a string id and name")
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise MessagesError(f"{where}: tool_use input must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _tool_messages(block: dict, where: str) -> list[dict]:
    """A ``tool_result`` as a ``tool`` message (its texts joined with newlines), then, if it holds
    images (a screenshot), a user message of them, and, if it names tools (Claude Code's tool
    search: ``tool_reference``), a ``tool`` message of those, as vLLM's ``/v1/messages`` renders it
    (other blocks it leaves out; a missing or null content is an empty result)."""
    if not isinstance(block.get("tool_use_id"), str):
        raise MessagesError(f"{where}: tool_result needs a string tool_use_id")
    content = block.get("content")
    if content is None or isinstance(content, str):
        return [{"role": "tool", "tool_call_id": block["tool_use_id"], "content": content or ""}]
    if not isinstance(content, list):
        raise MessagesError(f"{where}.content: expected a string or a list of blocks")
    texts, images, named = [], [], []
    for k, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            texts.append(item["text"] if isinstance(item.get("text"), str) else "")
        elif kind == "image":
            images.append(_image_part(item, f"{where}.content[{k}]"))
        elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
            named.append({"type": "tool_reference", "name": name})
    out = [{"role": "tool", "tool_call_id": block["tool_use_id"], "content": "\n".join(texts)}]
    out += [{"role": "user", "content": images}] if images else []
    return out + ([{"role": "tool", "tool_call_id": block["tool_use_id"], "content": named}] if named else [])


def _block(block: Any, role: str, at: str, out: dict) -> None:
    """One content block of a user or assistant turn into ``out`` (``parts``, ``reasoning``,
    ``calls``, ``tools``: the ``tool`` messages that go before the turn)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
        if block["text"]:  # an empty block adds nothing (vLLM leaves it out)
            out["parts"].append({"type": "text", "text": block["text"]})
    elif kind == "image":
        out["parts"].append(_image_part(block, at))
    elif kind == "tool_use" and role == "assistant":
        out["calls"].append(_tool_call(block, at))
    elif kind == "tool_result" and role == "user":
        out["tools"].extend(_tool_messages(block, at))
    elif kind == "thinking" and role == "assistant" and block.get("thinking") is None:
        return  # nothing to render (vLLM skips it)
    elif kind == "thinking" and role == "assistant" and isinstance(block["thinking"], str):
        out["reasoning"].append(block["thinking"])
    elif (kind == "redacted_thinking" and role == "assistant") or kind == "tool_reference":
        return  # opaque, or named only inside a tool_result: not rendered (as vLLM does)
    else:
        raise MessagesError(f"{at}: content block of type {kind!r} is not supported here")


def _message(msg: Any, i: int) -> list[dict]:
    """One Messages turn as the chat messages vLLM's ``/v1/messages`` builds for it: its tool results
    first, then the turn with ``reasoning`` (its thinking blocks joined), ``tool_calls`` and
    ``content``: one text block as a string, several blocks (or an image) as the list of parts, which
    vLLM's chat renderer hands a template that iterates over content parts as they are; no
    ``content`` when the turn has no block that renders (a user turn like that is left out)."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
        raise MessagesError(f"{where}: expected an object with role 'user', 'assistant' or 'system'")
    role, content = msg["role"], msg.get("content")
    if role == "system":
        return _system_turn(content, where)
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise MessagesError(f"{where}.content: expected a string or a list of content blocks")
    out: dict[str, list] = {"parts": [], "reasoning": [], "calls": [], "tools": []}
    for j, block in enumerate(content):
        _block(block, role, f"{where}.content[{j}]", out)
    chat: dict[str, Any] = {"role": role}
    if out["reasoning"]:
        chat["reasoning"] = "".join(out["reasoning"])
    if out["calls"]:
        chat["tool_calls"] = out["calls"]
    parts = out["parts"]
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    return out["tools"] + ([chat] if role == "assistant" or "content" in chat else [])


def _tools(tools: Any) -> list[dict]:
    """Custom tools as chat functions, as vLLM's ``/v1/messages`` reads them: ``input_schema`` is
    required (an object; one without ``type`` gets ``"type": "object"``), ``strict`` and
    ``defer_loading`` are kept."""
    if not isinstance(tools, list):
        raise MessagesError("tools: expected a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            raise MessagesError(f"tools[{i}]: only custom tools (name, description, input_schema) are supported here")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise MessagesError(f"tools[{i}].input_schema: an object (JSON schema) is required")
        fn = {"name": t["name"], "parameters": schema if "type" in schema else {**schema, "type": "object"}}
        for key in ("description", "strict", "defer_loading"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def _thinking(thinking: Any, max_tokens: int) -> dict:
    """The chat fields of ``thinking``, as vLLM's ``/v1/messages`` sets them: ``enabled`` is a
    thinking budget (``thinking_token_budget``: the engine ends the reasoning there; it needs a
    reasoning parser), ``disabled`` the reasoning effort ``none`` (a template's ``enable_thinking``
    false), ``adaptive`` nothing. Its rules: a budget of at least 1024 tokens, below ``max_tokens``."""
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "adaptive":
        return {}
    if kind == "disabled":
        return {"reasoning_effort": "none"}
    if kind != "enabled":
        raise MessagesError("thinking: expected {'type': 'enabled', 'budget_tokens': ...}, 'disabled' or 'adaptive'")
    budget = engine_int(thinking.get("budget_tokens"))
    if budget is None or not 1024 <= budget < max_tokens:
        raise MessagesError("thinking.budget_tokens: an integer of at least 1024 and less than max_tokens is required")
    return {"thinking_token_budget": budget}



def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """(chat ``tool_choice``, ``parallel_tool_calls`` or None)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    no_parallel = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if not reads_as_bool(no_parallel):
        raise MessagesError("tool_choice.disable_parallel_tool_use: a boolean is required")
    parallel = False if engine_flag(no_parallel) else None
    if kind in ("auto", "any"):
        return {"auto": "auto", "any": "required"}[kind], parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise MessagesError("tool_choice: expected {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}")


def _output_config(config: Any) -> dict:
    """The chat fields of ``output_config``: a JSON schema ``format`` constrains the answer
    (``response_format``), ``effort`` is the reasoning effort, as vLLM's ``/v1/messages`` reads them."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise MessagesError("output_config: expected an object")
    out: dict[str, Any] = {}
    fmt = config.get("format")
    if fmt is not None:  # (its type defaults to json_schema; an empty or missing schema constrains nothing)
        schema = fmt.get("schema") if isinstance(fmt, dict) else None
        if not isinstance(fmt, dict) or fmt.get("type", "json_schema") != "json_schema" \
                or not isinstance(schema, dict | None):
            raise MessagesError("output_config.format: expected {'type': 'json_schema', 'schema': {...}}")
        if schema:
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    if config.get("effort") is not None:
        if config["effort"] not in EFFORTS:
            raise MessagesError(f"output_config.effort: one of {', '.join(EFFORTS)} is required")
        out["reasoning_effort"] = config["effort"]
    return out


def to_chat(req: Any) -> dict:
    """The chat-completions request equivalent to a Messages request (see the module doc)."""
    if not isinstance(req, dict):
        raise MessagesError("the body must be a JSON object")
    if not isinstance(req.get("model"), str) or not req["model"]:
        raise MessagesError("model: a string is required")
    max_tokens = engine_int(req.get("max_tokens"))
    if max_tokens is None or max_tokens < 1:
        raise MessagesError("max_tokens: a positive integer is required")
    if not reads_as_bool(req.get("stream")):
        raise MessagesError("stream: a boolean is required")
    if not isinstance(req.get("messages"), list):
        raise MessagesError("messages: a list is required")
    messages = []
    system = _system(req["system"]) if req.get("system") is not None else ""
    if system:  # an empty system (or only empty blocks) adds no system message, as in vLLM's endpoint
        messages.append({"role": "system", "content": system})
    for i, msg in enumerate(req["messages"]):
        messages.extend(_message(msg, i))
    chat: dict[str, Any] = {k: v for k, v in req.items() if k not in _MESSAGES_FIELDS}
    last = req["messages"][-1] if req["messages"] else None
    if isinstance(last, dict) and last.get("role") == "assistant" and messages and messages[-1]["role"] == "assistant":
        # a last assistant turn is a prefill the answer continues (the Messages rule), not a
        # finished turn followed by a new one (the chat default)
        chat.setdefault("continue_final_message", True)
        chat.setdefault("add_generation_prompt", False)
    chat.update(model=req["model"], messages=messages, max_tokens=max_tokens)
    for key in _PASSED:
        if req.get(key) is not None:
            chat[key] = req[key]
    stop = req.get("stop_sequences")
    if stop:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise MessagesError("stop_sequences: expected a list of strings")
        chat["stop"] = stop
    if req.get("tools"):
        chat["tools"] = _tools(req["tools"])
    if req.get("tool_choice") is not None:
        chat["tool_choice"], parallel = _tool_choice(req["tool_choice"])
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    chat.update(_output_config(req.get("output_config")))
    if req.get("thinking") is not None:  # after the effort: disabled thinking overrides it, as in vLLM
        chat.update(_thinking(req["thinking"], max_tokens))
    if engine_flag(req.get("stream")):
        chat["stream"] = True
        # usage on every chunk: message_start can then say how long the prompt is
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


# -- answer ---------------------------------------------------------------------------------
def _input(arguments: Any) -> dict:
    """A native answer's streamed tool arguments as the span's ``input`` (arguments that are not a
    JSON object, say cut by max_tokens, give ``{}``; the span's record is no client's answer)."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):  # RecursionError: nested thousands deep
        return {}
    return value if isinstance(value, dict) else {}


def _answer_input(arguments: Any) -> dict | None:
    """A tool call's arguments as the ``input`` object, as vLLM's ``/v1/messages`` decodes them:
    text that is not JSON (a call cut by max_tokens) or JSON that is not an object (nor null, which
    leaves the block without ``input`` there) raises :class:`AnswerError`, where vLLM's endpoint
    answers 400. Arguments that are no text at all (a hostile upstream; vLLM's engine never makes
    them) are kept if an object, else ``{}``: the span keeps what the model wrote."""
    if not isinstance(arguments, str):
        return arguments if isinstance(arguments, dict) else {}
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        raise AnswerError(f"the tool call's arguments are not valid JSON: {exc}") from None
    except RecursionError as exc:  # nested thousands deep: no client error on vLLM's endpoint, a 500
        raise AnswerError(f"the tool call's arguments cannot be decoded: {exc}", status=500) from None
    if value is not None and not isinstance(value, dict):
        raise AnswerError(f"the tool call's arguments are JSON but not an object (a {type(value).__name__})")
    return value


def stop_reason(choice: dict, stop: Any, tool_used: bool = False, tool_complete: bool = False
                ) -> tuple[str | None, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat choice, as vLLM's ``/v1/messages`` maps them:
    ``length`` is ``max_tokens``; any finish reason but ``stop`` and ``tool_calls`` (none yet,
    ``abort``, ``repetition``, ``content_filter``...) has no Messages stop reason (null: a client
    must not read an engine's abort as a finished turn); then ``tool_use`` for a complete tool call
    (``tool_complete``: its arguments parse), which a named tool choice ends with ``finish_reason:
    "stop"``; then the stop string that ended the answer (vLLM's ``stop_reason``); then
    ``tool_use`` for any call made; else ``end_turn``."""
    finish = choice.get("finish_reason")
    matched = choice.get("stop_reason")
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(matched, str) and isinstance(stop, list) and matched in stop:
        return "stop_sequence", matched  # (a call the stop string cut short must not run)
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _is_json(text: Any) -> bool:
    """Whether a tool call's arguments are a whole JSON text (a call cut short is not)."""
    if not isinstance(text, str):
        return False
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _count(value: Any) -> int:
    """A usage count as the client expects it (a non-negative integer); anything else an upstream
    sends (a string, NaN, a list) is 0, never an exception in the middle of the answer."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0
    return max(int(value), 0)


def _usage(usage: Any) -> dict:
    usage = usage if isinstance(usage, dict) else {}
    return {"input_tokens": _count(usage.get("prompt_tokens")), "output_tokens": _count(usage.get("completion_tokens"))}


def _list(value: Any) -> list:
    """``value`` if it is a list, else empty (an upstream's ``choices`` or ``tool_calls`` of another type)."""
    return value if isinstance(value, list) else []


def _tool_block(tc: dict) -> dict:
    """The ``tool_use`` block (without input) of a chat tool call; an id or name that is not a
    string is replaced, never handed to the client as another type."""
    fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
    call_id = tc.get("id") if isinstance(tc.get("id"), str) and tc["id"] else f"toolu_{uuid.uuid4().hex[:24]}"
    return {"type": "tool_use", "id": call_id, "name": fn["name"] if isinstance(fn.get("name"), str) else ""}


def _key(value: Any) -> Any:
    """A tool call's ``index`` as a dict key (a hostile upstream's list or object is keyed by its text)."""
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def message_id(chat_id: Any) -> str:
    return f"msg_{chat_id}" if isinstance(chat_id, str) and chat_id else f"msg_{uuid.uuid4().hex}"


def untranslatable(chat: Any) -> AnswerError | None:
    """Why no Messages answer can be made of this chat answer (the harness gets vLLM's error for it,
    so its span is an error, never trained on, with the status the harness got), or None. Anything
    but an object is capture's to judge."""
    if not isinstance(chat, dict):
        return None
    try:
        _tool_uses(_first_choice(chat)[1])  # (what to_message decodes; the rest of it cannot fail)
    except AnswerError as exc:
        return exc
    return None


def _first_choice(chat: dict) -> tuple[dict, dict]:
    """(choice, message) of a chat completion's first choice, ``{}`` for either that is missing."""
    choices = _list(chat.get("choices"))
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    return choice, choice.get("message") if isinstance(choice.get("message"), dict) else {}


def _tool_uses(msg: dict) -> list[dict]:
    """The ``tool_use`` blocks of a chat message's tool calls, their arguments decoded as vLLM's
    ``/v1/messages`` decodes them (:func:`_answer_input`: raises :class:`AnswerError`)."""
    blocks = []
    for tc in _list(msg.get("tool_calls")):
        if isinstance(tc, dict):
            fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
            block, value = _tool_block(tc), _answer_input(fn.get("arguments"))
            blocks.append(block if value is None else {**block, "input": value})  # (null: none, as vLLM's)
    return blocks


def to_message(chat: dict, model: str | None, stop: Any = None) -> dict:
    """A chat completion (token fields already stripped) as the Messages answer; raises
    :class:`AnswerError` where vLLM's ``/v1/messages`` fails the answer."""
    choice, msg = _first_choice(chat)
    content: list[dict] = []
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})  # (as vLLM signs)
    if isinstance(msg.get("content"), str) and msg["content"]:
        content.append({"type": "text", "text": msg["content"]})
    content += _tool_uses(msg)
    if not content:  # vLLM's (and Anthropic's) empty answer: one empty text block, not []
        content.append({"type": "text", "text": ""})
    used = any(block["type"] == "tool_use" for block in content)  # (each decoded: complete, as vLLM reads it)
    reason, sequence = stop_reason(choice, stop, tool_used=used, tool_complete=used)
    return {"id": message_id(chat.get("id")), "type": "message", "role": "assistant",
            "model": model or _str(chat.get("model")), "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": _usage(chat.get("usage"))}


def error_body(status: int, message: str) -> dict:
    """The Anthropic error shape for an HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_from(status: int, body: Any, text: str | None) -> dict:
    """An upstream or proxy error answer (OpenAI or vLLM shape, or plain text) as an Anthropic one."""
    if isinstance(body, dict) and body.get("type") == "error":
        return body
    err = body.get("error") if isinstance(body, dict) else None
    message = err.get("message") if isinstance(err, dict) else body.get("message") if isinstance(body, dict) else None
    if not isinstance(message, str):
        message = (text or f"upstream answered HTTP {status}")[:2000]
    return error_body(status, message)


# -- event stream ---------------------------------------------------------------------------
def dumps(data: dict) -> bytes:
    """Compact UTF-8 JSON. A lone surrogate (upstream JSON may escape one: ``"\\ud800"``) cannot be
    UTF-8; it is written back as that same escape (backslashreplace makes exactly it, and it only
    occurs inside strings), never an exception mid-answer."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


def sse_event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n"


class EventTranslator:
    """Chat-completion chunks in, Messages stream events out (as SSE bytes), one chunk at a time.

    Reasoning deltas open a ``thinking`` block, text deltas a ``text`` block, each tool call a
    ``tool_use`` block once a delta gives its id and name together (its argument pieces are
    ``input_json_delta``); a block is stopped when the next kind starts or the answer ends.
    The answer ends as the span's does (:class:`AnswerEnd`): once choice 0 has ended and the usage
    of the whole answer is in (or at ``[DONE]``), ``message_delta`` (stop reason, output tokens) and
    ``message_stop`` go out, and what a hostile upstream sends after them (more deltas, another
    final chunk or usage) is not translated: the client and the span keep the same answer. Only an
    error still counts (the span says so too): an ``error`` event. ``finish()`` (on ``[DONE]``)
    ends an answer still open; ``end()`` (the upstream stream is over) ends one whose choices all
    ended, and gives any other an ``error`` event. After an ``error`` event nothing more is sent
    (the client stops there). ``on_error(text)`` hears of an upstream error event and of a chunk
    that could not be translated, so the span says the answer failed (its token ids go on past
    what the client accepted).
    """

    def __init__(self, model: str | None, stop: Any = None, on_error=None) -> None:
        self.model = model
        self.stop = stop
        self.on_error = on_error
        self.started = self.finished = False
        self.stopped = False  # message_stop sent: only an error event may follow
        self.block: tuple[str, Any] | None = None  # ('text', -1) or ('tool', call id) now open
        self.held_text: list[str] = []  # text that came while a tool call was open: its own block after it
        self.tool_args: list[str] | None = None  # the last tool call's argument pieces (None: no call)
        self.tool_ids: dict[Any, str] = {}  # a call's index -> the id its first delta gave it
        self.index = -1  # content block index
        self.choice: dict = {}
        self.end_rule = AnswerEnd()

    def chunk(self, obj: dict) -> Iterator[bytes]:
        if self.finished:
            return
        if obj.get("error") is not None or obj.get("object") == "error":  # (as the span's assembler reads it)
            message = error_from(500, obj, None)["error"]["message"]
            yield from self.fail(message, report=stream_error(obj, message))
            return
        if self.stopped:  # the answer has ended: nothing after it is part of it
            return
        if not self.started:
            yield from self._start(obj)
        for ch in _list(obj.get("choices")):
            if isinstance(ch, dict):
                yield from self._choice(ch)
        self.end_rule.take_usage(obj.get("usage"), bool(_list(obj.get("choices"))))
        if self.end_rule.ended.get(0) and self.end_rule.usage_final:
            yield from self._stop()

    def _choice(self, ch: dict) -> Iterator[bytes]:
        """One choice of a chunk: choice 0's deltas as events, up to and with its final chunk; the
        end of every choice is noted (the usage is the answer's once all have ended)."""
        idx = ch.get("index", 0)
        if not self.end_rule.choice(idx, ch.get("finish_reason")) or idx != 0:
            return
        delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:  # as to_message keeps it: a thinking block first
            yield from self._open(("thinking", -1), {"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": reasoning})
        if isinstance(delta.get("content"), str) and delta["content"]:
            if self.block is not None and self.block[0] == "tool":  # kept for after the call, as vLLM does:
                self.held_text.append(delta["content"])  # a text block inside it would split the call
            else:
                yield from self._open(("text", -1), {"type": "text", "text": ""})
                yield self._delta({"type": "text_delta", "text": delta["content"]})
        for tc in _list(delta.get("tool_calls")):
            yield from self._tool_piece(tc)
        for key in ("finish_reason", "stop_reason"):
            if ch.get(key) is not None:
                self.choice[key] = ch[key]

    def _start(self, obj: dict) -> Iterator[bytes]:
        self.started = True
        message = {"id": message_id(obj.get("id")), "type": "message", "role": "assistant",
                   "model": self.model or _str(obj.get("model")), "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": {**_usage(obj.get("usage")), "output_tokens": 0}}
        yield sse_event("message_start", {"type": "message_start", "message": message})

    def _tool_piece(self, tc: Any) -> Iterator[bytes]:
        """One tool-call delta, read as vLLM's ``/v1/messages`` reads it: a delta with an ``id`` and a
        function ``name`` opens the call's ``tool_use`` block (unless that call's block is the one
        open); a delta with only an ``id`` names the call at its index and opens nothing, so a call
        whose name never comes with its id is left out (it was opened with ``name: ""``, a call
        the client could not run); argument pieces (by id, or by the index an id was given at) go
        to the call's block only while it is the open one."""
        if not isinstance(tc, dict):
            return
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
        index = _key(tc.get("index"))
        call_id = tc.get("id") if isinstance(tc.get("id"), str) else None
        if call_id is None:
            call_id = self.tool_ids.get(index)
        else:
            self.tool_ids[index] = call_id
            if self.block != ("tool", call_id) and isinstance(fn.get("name"), str):
                yield from self._open(("tool", call_id), {"type": "tool_use", "id": call_id, "name": fn["name"],
                                                          "input": {}})
                self.tool_args = []
        pieces = fn.get("arguments")
        if call_id is not None and self.block == ("tool", call_id) and isinstance(pieces, str) and pieces:
            self.tool_args.append(pieces)
            yield self._delta({"type": "input_json_delta", "partial_json": pieces})

    def _open(self, block: tuple[str, Any], content_block: dict) -> Iterator[bytes]:
        if self.block == block:
            return
        yield from self._close()
        self.index += 1
        self.block = block
        yield sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                "content_block": content_block})

    def _close(self) -> Iterator[bytes]:
        """Stop the open block; a thinking block gets its signature first, as vLLM's ``/v1/messages``
        signs one (a random hex: a client that sends thinking back expects one). Text held back while
        a tool call was open follows as a block of its own."""
        if self.block is not None:
            if self.block[0] == "thinking":
                yield self._delta({"type": "signature_delta", "signature": uuid.uuid4().hex})
            self.block = None
            yield sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        if self.held_text:
            text, self.held_text = "".join(self.held_text), []
            yield from self._open(("text", -1), {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": text})
            yield from self._close()

    def _delta(self, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def finish(self) -> Iterator[bytes]:
        """``[DONE]``: the answer ends here if it has not yet (nothing after ``[DONE]`` counts)."""
        if self.finished:
            return
        yield from self._stop()
        self.finished = True

    def end(self) -> Iterator[bytes]:
        """The upstream stream is over: an answer whose choices all ended is whole (the span says
        so too, ``[DONE]`` or not); any other was cut short, and gets an ``error`` event."""
        if self.stopped or self.end_rule.finished:
            yield from self.finish()
        else:
            yield from self.fail("the upstream event stream ended before the answer was complete")

    def _stop(self) -> Iterator[bytes]:
        """``message_delta`` (stop reason, usage) and ``message_stop``, once."""
        if self.stopped:
            return
        if not self.started:
            yield from self._start({})
        yield from self._close()
        self.stopped = True
        used = self.tool_args is not None
        # no finish reason yet (``[DONE]`` before it) reads as ``stop``, as vLLM's converter reads it
        ended = {**self.choice, "finish_reason": self.choice.get("finish_reason") or "stop"}
        reason, sequence = stop_reason(ended, self.stop, tool_used=used,
                                       tool_complete=used and _is_json("".join(self.tool_args)))
        usage = _usage(self.end_rule.usage)
        yield sse_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                              "stop_sequence": sequence},
                                          "usage": usage})
        yield sse_event("message_stop", {"type": "message_stop"})

    def fail(self, message: str, report: str | None = None) -> Iterator[bytes]:
        """The ``error`` event that ends the stream; ``report``: what the span should say (None: the
        proxy records this failure itself, as a stream cut short)."""
        if self.finished:
            return
        self.finished = True
        if report and self.on_error:
            self.on_error(report)
        yield sse_event("error", error_body(500, message))


class EventStream:
    """Wraps a relay's output (chat-completion SSE bytes, partial events possible) and returns the
    Messages events for it: installed around capture's relay as ``flow.response.stream``. Returns a
    list (never ``b""``) while nothing is ready, like the relay. An event longer than ``max_event``
    (the relay's bound, which it then stops parsing at) ends the answer with an ``error`` event, and
    once the stream has ended (an ``error`` event or ``[DONE]``) nothing more is kept: memory stays
    bounded as the relay's does. Between ``message_stop`` and then, events are still read, one at a
    time, for an error among them."""

    def __init__(self, inner, translator: EventTranslator, max_event: int | None = None) -> None:
        self.inner = inner
        self.translator = translator
        self.max_event = max_event
        self.buf = bytearray()

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        got = self.inner(chunk)
        if self.translator.finished:  # nothing more goes to the client
            return []
        self.buf += b"".join(got) if isinstance(got, list) else got
        out = list(self._events())
        if self.max_event is not None and len(self.buf) > self.max_event:
            self.buf.clear()  # (capture records the stream as too_large)
            out += self.translator.fail(f"an upstream event is longer than {self.max_event} bytes (max_decoded_size)")
        if not chunk:  # end of stream
            if self.buf.strip():
                out += self._block(bytes(self.buf))
            self.buf.clear()
            out += self.translator.end()
        return b"".join(out) if out else []

    def _events(self) -> Iterator[bytes]:
        start = 0
        for end in EVENT_END.finditer(self.buf):
            yield from self._block(bytes(self.buf[start:end.start()]))
            start = end.end()
        del self.buf[:start]

    def _block(self, block: bytes) -> list[bytes]:
        data = b"\n".join(line[5:].lstrip(b" ") for line in block.splitlines() if line.startswith(b"data:"))
        if not data:
            return []
        try:
            if data.strip() == b"[DONE]":
                return list(self.translator.finish())
            obj = _loads(data)
            return list(self.translator.chunk(obj)) if isinstance(obj, dict) else []
        except Exception as exc:  # raised into mitmproxy, it would leave the client waiting, unanswered
            why = f"a chunk could not be translated ({type(exc).__name__}: {exc})"
            return list(self.translator.fail(why, report=why))


def _loads(data: bytes) -> Any:
    """An event's JSON value, or None where it is not JSON (capture records the malformed event;
    the harness gets the rest)."""
    try:
        return json.loads(data.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return None


def stream_error(obj: dict, message: Any) -> str:
    """What a span says of an error event in an answer's stream (vLLM sends one when generation
    fails mid-way, then ``[DONE]``; Messages and Responses streams have their own): the answer is
    no clean one, whatever it holds so far. The assemblers of every endpoint keep it."""
    if isinstance(obj.get("error"), dict):
        message = obj["error"].get("message", message)
    return f"upstream sent an error event mid-stream: {str(message)[:500]}"


class AnswerEnd:
    """Where a streamed chat or completions answer ends, one rule for the span (``StreamAssembler``)
    and for the client's Messages stream (``EventTranslator``), so the two cannot disagree: a choice
    ends with its ``finish_reason`` chunk (nothing of it after that is part of the answer). The
    usage is that of the chunk that ended the last choice, or else of the usage-only chunk vLLM
    sends right after it (``include_usage``); with several choices that chunk's wins: with
    ``continuous_usage_stats`` each chunk holds its own choice's running count, and only the last
    one the whole answer's. Nothing after it counts."""

    def __init__(self) -> None:
        self.ended: dict[Any, bool] = {}  # each choice seen: whether its final chunk came
        self.usage: Any = None
        self.usage_final = False  # the usage of the whole answer is in: later ones are ignored
        self._over = False  # every choice had ended before the chunk now read

    def choice(self, index: Any, finish_reason: Any) -> bool:
        """Note a choice's chunk; False if that choice had ended already (the chunk is no part of it)."""
        if self.ended.get(index):
            return False
        self.ended[index] = finish_reason is not None
        return True

    def take_usage(self, usage: Any, with_choices: bool) -> None:
        """A chunk's usage, after its choices were noted."""
        if self.usage_final:
            return
        if not self._over:
            if usage:
                self.usage = usage
            self._over = self.finished  # one choice: its own count is the answer's
            self.usage_final = self._over and bool(usage) and len(self.ended) == 1
        elif usage and not with_choices:
            self.usage, self.usage_final = usage, True

    @property
    def finished(self) -> bool:
        """Every choice seen has had its final chunk (a stream cut short has not)."""
        return bool(self.ended) and all(self.ended.values())


class MessageAssembler:
    """Folds a Messages event stream from an upstream that speaks it natively (a hosted
    ``api.anthropic.com`` call not routed to the pool) into the ``message`` object for the span.

    ``message_stop`` ends the answer, as it ends an Anthropic stream: what a hostile upstream sends
    after it (more deltas, another ``message_delta`` with another stop reason and usage) is no part
    of it (a client may stop reading there; the SDKs' ``message_stop`` event holds the message as it
    was), so it changes nothing, as the first final event of a chat or Responses stream ends its
    answer; an ``error`` event still counts (the SDKs raise on one wherever it comes)."""

    def __init__(self) -> None:
        self.message: dict[str, Any] = {"type": "message", "content": []}
        self.blocks: dict[int, dict] = {}
        self.finished = False  # saw message_stop
        self.error: str | None = None  # an error event came: the answer is no clean one

    def add(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "error":
            self.message["error"] = event.get("error")
            if self.error is None:
                self.error = stream_error(event, event.get("error"))
        elif self.finished:
            return
        elif kind == "message_start" and isinstance(event.get("message"), dict):
            self.message.update(json.loads(json.dumps(event["message"])))
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            self.blocks[int(event.get("index") or 0)] = dict(event["content_block"])
        elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
            block = self.blocks.setdefault(int(event.get("index") or 0), {})
            delta = event["delta"]
            for key in ("text", "partial_json", "thinking", "signature"):  # (a signature comes as one delta)
                if isinstance(delta.get(key), str):
                    block[key] = block.get(key, "") + delta[key]
        elif kind == "message_delta":
            self.message.update(event.get("delta") or {})
            if isinstance(event.get("usage"), dict):
                self.message["usage"] = {**(self.message.get("usage") or {}), **event["usage"]}
        elif kind == "message_stop":
            self.finished = True

    def result(self) -> dict:
        blocks = []
        for i in sorted(self.blocks):
            block = dict(self.blocks[i])
            if block.get("type") == "tool_use" and "partial_json" in block:
                block["input"] = _input(block.pop("partial_json"))
            blocks.append(block)
        return {**self.message, "content": blocks}


def message_token_fields(obj: dict, out: dict) -> dict:
    """Span fields of a native Messages answer: no token ids, the stop reason and usage counts."""
    out["n_choices"] = 1
    out["finish_reason"] = obj.get("stop_reason")
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    out["prompt_tokens"], out["completion_tokens"] = usage.get("input_tokens"), usage.get("output_tokens")
    return out
