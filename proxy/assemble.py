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

import json
import marshal
from typing import Any

from .anthropic import MESSAGES, AnswerEnd, MessageAssembler, message_token_fields, stream_error, to_chat
from .lax import engine_flag, engine_float

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


RESPONSE_END = ("response.completed", "response.incomplete", "response.failed")  # a whole stream ends with one
FINAL_STATUSES = ("completed", "incomplete")  # a Responses object that holds a whole answer (cut or not)
FAILED_STATUSES = ("failed", "cancelled")  # one whose generation failed or was aborted: no answer


class ResponsesAssembler:
    """Keeps the whole response object a Responses event stream ends with (``response.completed``,
    ``.incomplete`` or ``.failed``); a stream cut short keeps the last ``response`` seen plus the
    output items finished so far.

    Not a clean answer (``error``): an ``error`` event, any event with a top-level ``error`` (the
    openai client raises on one), a failed response, a final event whose response failed or was
    cancelled, or one without a response object. The first final event ends the answer: what a
    hostile upstream sends after it (more output, another final event) never changes it, as the
    client keeps that one (Codex stops reading there); only an error among it still counts."""

    def __init__(self) -> None:
        self.response: dict[str, Any] | None = None
        self.items: dict[int, dict] = {}
        self.chunks = 0
        self.finished = False  # saw the event a whole stream ends with
        self.error: str | None = None  # an error event or a failed response: the answer is no clean one

    def add(self, event: dict) -> None:
        self.chunks += 1
        kind = event.get("type")
        resp = event.get("response")  # (the relay's own parse: its filters rewrite another copy)
        if kind in ("error", "response.failed") or event.get("error"):
            self._fail(resp if isinstance(resp, dict) else event, event.get("message", kind))
        if self.finished:
            return
        if kind in RESPONSE_END:
            self.finished = True
            if not isinstance(resp, dict):
                self._fail({}, f"{kind} without its response object")
            elif resp.get("status") in FAILED_STATUSES or resp.get("error"):
                self._fail(resp, f"{kind} with a response whose status is {resp.get('status')!r}")
        if isinstance(resp, dict):
            self.response = resp
        if kind == "response.output_item.done" and isinstance(event.get("item"), dict):
            self.items[int(event.get("output_index") or 0)] = event["item"]

    def _fail(self, obj: dict, message: Any) -> None:
        if self.error is None:
            self.error = stream_error(obj, message)

    def result(self) -> dict:
        obj = dict(self.response or {"object": "response"})
        if not self.finished and not obj.get("output") and self.items:  # cut short: the items done so far
            obj["output"] = [self.items[i] for i in sorted(self.items)]
        return obj


def unfinished_response(obj: dict) -> tuple[str | None, str | None]:
    """(error kind, error) of a Responses JSON answer that holds no whole answer: failed or cancelled
    (the harness got no answer), queued or in progress (``background``: the answer comes later from
    ``GET /v1/responses/{id}``, which is not a model call and is not recorded)."""
    status = obj.get("status")
    if status in FAILED_STATUSES:
        err = obj.get("error")
        return "malformed_response", f"response {status}: {err.get('message') if isinstance(err, dict) else err}"
    if status in ("queued", "in_progress"):
        return "truncated", f"response {status} (background): its answer is not in this call, nothing to record"
    return None, None


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


class _Packed:
    """A logprobs list being assembled (chat: ``content``, one object per token), packed ``PACK_AT``
    items at a time and unpacked once in ``result()``.

    Why: a chat logprob entry is a dict holding two lists: ~530 bytes and 3 objects the collector
    tracks, per token, for as long as the stream lasts. With 832,000 tokens in flight (64 streams of
    13,000) one full collection took 0.42 s, during which the proxy (one event loop) serves nothing;
    packed, a token holds ~185 bytes and 0.05 tracked objects, and it took 0.04 s; feeding a token
    got cheaper, the unpacking at the stream's end costs ~1.5 us a token (scripts/bench_assembly.py).
    ``marshal`` gives back exactly what it was given (every value JSON parses to, NaN and big integers
    included, key order kept); a value it cannot hold (none JSON makes) stops the packing, never the
    assembly."""

    __slots__ = ("blobs", "items", "packing")
    PACK_AT = 512

    def __init__(self) -> None:
        self.blobs: list[bytes] = []
        self.items: list = []
        self.packing = True

    def extend(self, values: list) -> None:
        self.items.extend(values)
        if self.packing and len(self.items) >= self.PACK_AT:
            try:
                self.blobs.append(marshal.dumps(self.items))
            except ValueError:
                self.packing = False
                return
            self.items = []

    def unpacked(self) -> list:
        out: list = []
        for blob in self.blobs:
            out += marshal.loads(blob)
        return out + self.items


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
    lp = out.get("logprobs")
    if isinstance(lp, dict):
        out["logprobs"] = {k: v.unpacked() if isinstance(v, _Packed) else v for k, v in lp.items()}
    msg = out.get("message")
    if isinstance(msg, dict):
        msg = out["message"] = _joined(msg)
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [{**call, "function": _joined(call["function"])} for call in msg["tool_calls"]]
    return out


class StreamAssembler:
    """Folds ``chat.completion.chunk`` / ``text_completion`` chunks into one completion object.

    The answer ends where :class:`AnswerEnd` says: what a hostile upstream sends after that (more
    content or token ids, another final chunk) is no part of the answer the client kept (one may
    stop reading there), so it changes nothing; an error still counts."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.end_rule = AnswerEnd()
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
        if self.prompt_token_ids is None and get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        for ch in get("choices") or ():
            self._add_choice(ch)
        self.end_rule.take_usage(get("usage"), bool(get("choices")))

    def _add_choice(self, ch: dict) -> None:
        get = ch.get
        idx = get("index", 0)
        if not self.end_rule.choice(idx, get("finish_reason")):
            return
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
        return self.end_rule.finished

    def _add_logprobs(self, acc: dict, lp: dict) -> None:
        dst = acc.get("logprobs")
        if dst is None:
            dst = acc["logprobs"] = {}
        for key, value in lp.items():
            if isinstance(value, list):
                cur = dst.get(key)
                if not isinstance(cur, _Packed):
                    cur = dst[key] = _Packed()
                cur.extend(value)
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
        if self.end_rule.usage is not None:
            obj["usage"] = self.end_rule.usage
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
        return _checked(_responses_token_fields(obj, out))
    if endpoint == MESSAGES:
        return _checked(message_token_fields(obj, out))
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
    out["response_logprobs"] = _answer_logprobs(out["response_logprobs"], out["response_token_ids"],
                                                out["prompt_token_ids"])
    return _checked(_token_counts(out, obj.get("usage"), "prompt_tokens", "completion_tokens",
                                  count_ids=len(choices) == 1))


def behaviour_logprobs(request: Any, endpoint: str | None, lps: list[float] | None) -> list[float] | None:
    """The recorded logprobs as those of the policy that chose the tokens (the update's mu). The engine
    returns the sampling distribution's (launcher/engine.py), except where nothing was sampled: at
    temperature 0 (greedy) and with beam search every token was chosen with probability 1, while vLLM
    returns the softmax at temperature 1 (-1.98 for a token it picked for certain): they are 0. A
    Responses answer with ``ignore_eos`` may hold a text-less end-of-turn token anywhere, whose
    missing logprob was padded as if it were the last: none are kept (the update recomputes them)."""
    if lps is None or not isinstance(request, dict):
        return lps
    beam = endpoint != RESPONSES and engine_flag(request.get("use_beam_search"))  # (Responses has no such field)
    if engine_float(request.get("temperature")) == 0.0 or beam:
        return [0.0] * len(lps)
    if endpoint == RESPONSES and engine_flag(request.get("ignore_eos")) and any(x != x for x in lps):
        return None
    return lps


def _answer_logprobs(lps: list[float] | None, ids: list[int] | None, prompt: list[int] | None) -> list[float] | None:
    """One logprob per response token id, or None. A completions call with ``echo`` gets the
    prompt's logprobs first (the first one null) and its token ids without them, so the answer's
    are the tail; logprobs of any other count than the ids' cannot be placed on their tokens (an
    entry that is no object was skipped, say): none are kept (the update recomputes them), never
    shifted onto other tokens. Without ids (to be rebuilt by the trainer) they are kept as sent."""
    if lps is None or ids is None or len(lps) == len(ids):
        return lps
    if prompt is not None and len(lps) == len(prompt) + len(ids):
        return lps[len(prompt):]
    return None


def _responses_token_fields(obj: dict, out: dict[str, Any]) -> dict[str, Any]:
    """Token fields of a Responses object. Token ids only from an object that holds a whole answer
    (status completed or incomplete: a queued, in-progress, failed or cancelled one is no answer the
    client got), and response ids only from one generation (one ``output_messages`` entry: a
    server-side tool loop lists later turns' prompts and tool output there, which the model did
    not generate)."""
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
        return ids or None

    final = obj.get("status") in FINAL_STATUSES
    outs = obj.get("output_messages")
    out["n_choices"] = 1
    out["prompt_token_ids"] = tokens("input_messages") if final else None
    one = final and isinstance(outs, list) and len(outs) == 1
    out["response_token_ids"] = tokens("output_messages") if one else None
    output = obj.get("output")
    items = [it for it in output if isinstance(it, dict)] if isinstance(output, list) else []
    lps: list = []
    for it in items:
        parts = it.get("content") if it.get("type") == "message" else None
        for part in parts if isinstance(parts, list) else ():
            if isinstance(part, dict) and isinstance(part.get("logprobs"), list):
                lps += [lp for lp in part["logprobs"] if isinstance(lp, dict)]
    out["response_logprobs"] = _floats([lp.get("logprob") for lp in lps]) if lps else None
    ids, got = out["response_token_ids"], out["response_logprobs"]
    if ids and got and len(got) < len(ids):  # (an answer cut short may miss a logprob anywhere)
        out["response_logprobs"] = _pad_last(got, lps, ids, outs) if obj.get("status") == "completed" else None
    details = obj.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    if reason:
        out["finish_reason"] = "length" if reason == "max_output_tokens" else reason
    elif obj.get("status") in FAILED_STATUSES:
        out["finish_reason"] = obj["status"]
    elif any(it.get("type") == "function_call" for it in items):
        out["finish_reason"] = "tool_calls"
    elif obj.get("status") == "completed":
        out["finish_reason"] = "stop"
    return _token_counts(out, obj.get("usage"), "input_tokens", "output_tokens", count_ids=True)


def _pad_last(got: list[float], entries: list[dict], ids: list[int], outs: list) -> list[float] | None:
    """Logprobs for every response id when the answer's logprob entries miss only its last token.

    vLLM streams a Responses answer's logprobs only with the text deltas of its message: a token
    whose delta has no text (the end-of-turn token, most often the only one missing), a reasoning
    or tool-call token, or the first bytes of a character split over tokens has none in the final
    object, wherever it stood. One missing token whose absence leaves the text whole (the
    entries' token strings spell the generated text, whitespace aside: some tokenizers decode a
    lone token without its leading space) is taken for the last: it is NaN (unknown). (Left
    possible: a text-less special token mid-answer with ``ignore_eos``: see behaviour_logprobs.)
    Otherwise the entries cannot be placed on their tokens and none is kept (the update
    recomputes them), never shifted onto other tokens."""
    if len(ids) - len(got) != 1:
        return None
    text = outs[0].get("message") if isinstance(outs[0], dict) else None
    spelled = [e.get("token") for e in entries]
    if not isinstance(text, str) or not all(isinstance(t, str) for t in spelled):
        return None
    if "".join("".join(spelled).split()) != "".join(text.split()):
        return None
    return got + [float("nan")]


def as_chat(endpoint: str | None, request: dict, response: dict, strict: bool = False) -> tuple[dict, dict]:
    """A recorded call's request and answer as the chat request and completion the model saw.

    Why here: the trainer rebuilds token ids of spans without them by rendering this chat form with
    the tokenizer's chat template, and this module (with anthropic.py) is what knows each format.
    A Messages request becomes the chat request the proxy sent upstream (its answer is already a
    chat completion); a Responses call (its endpoint, else told by its ``input``) becomes
    :func:`responses_to_chat`. ``strict`` (retokenisation): a Responses call whose chat form would
    not be what the engine rendered raises ``ValueError`` instead (the report shows what it can).
    """
    if endpoint == MESSAGES:
        request = to_chat(request)
    if endpoint == RESPONSES or "input" in request and "messages" not in request and "prompt" not in request:
        return responses_to_chat(request, response, strict)
    return request, response


# Responses request fields that bring context the span does not hold (stored responses, a stored
# conversation or prompt template, vLLM's history field): the engine's prompt had more than ``input``
HISTORY_FIELDS = ("previous_response_id", "previous_input_messages", "conversation", "prompt")
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}  # content part type -> its text's key (vLLM reads these as text)


def _text_of(content: Any, refuse=None, sep: str = "\n") -> str:
    """A content's text: a string, or its text parts joined by ``sep`` (vLLM joins a message's
    parts with a newline); ``refuse`` is told of parts that are not text (an image, a file)."""
    if isinstance(content, str):
        return content
    texts = []
    for p in content if isinstance(content, list) else ():
        key = TEXT_PARTS.get(p.get("type", "text")) if isinstance(p, dict) else None
        if key is None or not isinstance(p.get(key), str):
            if refuse is not None:
                refuse(f"a content part of type {p.get('type') if isinstance(p, dict) else type(p).__name__!r} "
                       "(not text)")
            continue
        texts.append(p[key])
    return sep.join(texts)


def _as_text_part(part: Any) -> Any:
    """A Responses text part (``input_text``, ``output_text``) as a chat text part; any other as it is."""
    key = TEXT_PARTS.get(part.get("type", "text")) if isinstance(part, dict) else None
    return {"type": "text", "text": part[key]} if key and isinstance(part.get(key), str) else part


def _function_call(item: dict) -> dict:
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""}}


def _engine_arguments(arguments: Any) -> dict:
    """Tool-call arguments as vLLM gives them to the chat template (``_postprocess_messages``): a
    JSON object's string parsed; anything else (not JSON, not an object, empty) an empty object."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _reasoning_of(item: dict, refuse) -> str:
    """A reasoning item's text as vLLM reads it: its first content part, else its first summary."""
    if item.get("encrypted_content"):
        refuse("a reasoning item with encrypted content")
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts and isinstance(parts[0], dict) and isinstance(parts[0].get("text"), str):
            return parts[0]["text"]
    return ""


def _input_message(messages: list[dict], it: dict, refuse) -> None:
    """Append one Responses input item to the chat messages the way vLLM renders it
    (``construct_chat_messages_with_tool_call``): a tool call, reasoning or an assistant text joins
    an assistant message just before it that lacks that part; other messages stand as they are."""
    kind = it.get("type", "message" if "role" in it else None)
    prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind == "function_call":
        if prev is not None and isinstance(prev.get("tool_calls", []), list):
            prev.setdefault("tool_calls", []).append(_function_call(it))
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [_function_call(it)]})
    elif kind == "reasoning":
        text = _reasoning_of(it, refuse)
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            messages.append({"role": "assistant", "content": None, "reasoning": text})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": it.get("call_id"),
                         "content": _text_of(it.get("output"), refuse)})
    elif kind == "message" and it.get("role") == "assistant":
        content = it.get("content")  # vLLM reads an assistant item's first part only
        first = content[0] if isinstance(content, list) and content else content
        text = first if isinstance(first, str) else _text_of([first], refuse) if isinstance(first, dict) else None
        if prev is not None and prev.get("content") is None and text is not None:
            prev["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
    elif kind == "message" and isinstance(it.get("role"), str):  # its parts as parts: a template that
        content = it.get("content")  # iterates over them gets them one by one (joined, for one that does not)
        text = _text_of(content, refuse)  # (refuse hears of a part that is not text)
        messages.append({"role": it["role"], "content": [_as_text_part(p) for p in content]
                         if isinstance(content, list) else text})
    else:  # item_reference, hosted tools' calls, custom tools: not rendered by this conversion
        refuse(f"an input item of type {kind!r}")


def _answer(resp: dict, refuse) -> tuple[dict, list]:
    """The assistant message a Responses answer renders like, and its output text logprobs."""
    if resp.get("status") not in FINAL_STATUSES:
        refuse(f"the response holds no whole answer (status {resp.get('status')!r})")
    for key in ("input_messages", "output_messages"):
        msgs = resp.get(key) if isinstance(resp.get(key), list) else []
        if any(isinstance(m, dict) and m.get("type") != "raw_message_tokens" and "tokens" not in m for m in msgs):
            refuse(f"{key} lists messages, not tokens: the engine renders this model (Harmony), not its template")
    if isinstance(resp.get("output_messages"), list) and len(resp["output_messages"]) > 1:
        refuse("the answer took several generations (a server-side tool loop)")
    output = resp.get("output")
    if not isinstance(output, list):
        refuse("the response has no output list")
        output = []
    text, calls, reasoning, logprobs = [], [], [], []
    for it in output:
        kind = it.get("type") if isinstance(it, dict) else None
        if kind == "message":
            for part in it.get("content") or ():
                if isinstance(part, dict):
                    text.append(part["text"] if isinstance(part.get("text"), str) else "")
                    logprobs += [{"logprob": lp.get("logprob"), "token": lp.get("token")}
                                 for lp in part.get("logprobs") or () if isinstance(lp, dict)]
        elif kind == "function_call":
            calls.append(_function_call(it))
        elif kind == "reasoning":
            reasoning.append(_reasoning_of(it, refuse))
        else:
            refuse(f"an output item of type {kind!r}")
    # (no text: "", as vLLM renders the answer's items in the next turn's prompt)
    msg = {"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})}
    if reasoning:
        msg["reasoning"] = msg["reasoning_content"] = "".join(reasoning)
    return msg, logprobs


def responses_to_chat(req: dict, resp: dict, strict: bool = False) -> tuple[dict, dict]:
    """A Responses API request/response pair as the chat request/completion it renders like, built
    as vLLM builds the chat messages it renders (non-Harmony models): ``instructions`` -> system
    message; ``input`` messages (text parts joined by newlines), ``function_call``, ``reasoning``
    and ``function_call_output`` items -> chat messages, assistant ``tool_calls`` / ``reasoning``
    and tool messages; ``output`` -> the assistant message (output text logprobs kept).

    ``strict``: raise ``ValueError`` where the result would not be the prompt the engine saw or
    the whole answer: history named by ``previous_response_id`` (and the like), images or files,
    encrypted reasoning, items of other types, a response that is no finished answer, reasoning
    hidden (``include_reasoning`` false), a last output item the engine continued (in progress)."""
    def refuse(why: str) -> None:
        if strict:
            raise ValueError(f"a Responses call that cannot be rebuilt exactly: {why}")

    for key in HISTORY_FIELDS:
        if req.get(key):
            refuse(f"{key} brings context the span does not hold")
    if not engine_flag(req.get("include_reasoning", True)):
        refuse("include_reasoning: false hides reasoning tokens the model generated")
    items = req.get("input")
    last = items[-1] if isinstance(items, list) and items else None
    if isinstance(last, dict) and last.get("type", "message") in ("message", "reasoning") \
            and last.get("status") in ("in_progress", "incomplete"):
        refuse("a last output item still in progress: the engine continued it, in its turn")
    messages: list[dict] = []
    if req.get("instructions"):
        messages.append({"role": "system", "content": _text_of(req["instructions"], refuse)})
    for it in [{"role": "user", "content": items}] if isinstance(items, str) else items or ():
        if isinstance(it, dict):
            _input_message(messages, it, refuse)
        else:
            refuse(f"an input item that is no object ({type(it).__name__})")
    for m in messages:
        if m["role"] == "assistant":
            if m.get("content") is None:  # vLLM renders an assistant message without text as ""
                m["content"] = ""
            if "reasoning" in m:  # and hands its reasoning to the template under both names
                m["reasoning_content"] = m["reasoning"]
    tools = []
    for t in req.get("tools") or ():
        if isinstance(t, dict) and t.get("type") == "function":
            # as vLLM hands a function tool to the template (its FunctionDefinition dumped: no key left out)
            fn = {k: t.get(k) for k in ("name", "description", "parameters")}
            fn |= {k: engine_flag(t[k]) for k in ("strict", "defer_loading") if t.get(k) is not None}
            tools.append({"type": "function", "function": fn})
        elif not isinstance(t, dict) or t.get("type") in ("namespace", "custom"):
            refuse("a tool that is not a function")  # (vLLM shows a custom tool as a function of its own making)
    msg, logprobs = _answer(resp, refuse)
    if strict:  # the template gets tool-call arguments as vLLM hands them to it: parsed
        for m in [*messages, msg]:
            for call in m.get("tool_calls") or () if m["role"] == "assistant" else ():
                call["function"]["arguments"] = _engine_arguments(call["function"]["arguments"])
    # (vLLM's Responses endpoint encodes the rendered prompt with the tokenizer's BOS: chat's does not)
    chat_req = {"messages": messages, **({"tools": tools} if tools else {}), "add_special_tokens": True}
    if isinstance(req.get("chat_template_kwargs"), dict):
        chat_req["chat_template_kwargs"] = req["chat_template_kwargs"]
    effort = req["reasoning"].get("effort") if isinstance(req.get("reasoning"), dict) else None
    if effort is not None:  # the template gets it, and thinking on unless "none" (as for a chat call)
        chat_req["reasoning_effort"] = effort
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


def _checked(out: dict[str, Any]) -> dict[str, Any]:
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
        out = [float("nan") if v is None else float(v) for v in value]
    except (TypeError, ValueError):
        return None
    # a string or a bool is no logprob, whatever float() makes of it ("-0.5", true -> 1.0)
    return None if any(type(v) is str or type(v) is bool for v in value) else out
