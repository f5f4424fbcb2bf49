"""Messages <-> chat completions, without a proxy: request translation rules, the event stream
built from chat chunks (split anywhere), native stream assembly and error shapes."""

from __future__ import annotations

import json
import re

import pytest

from lightning_harness.proxy.anthropic import (
    AnswerError,
    EventStream,
    EventTranslator,
    MessageAssembler,
    MessagesError,
    error_from,
    to_chat,
    to_message,
)
from lightning_harness.proxy.assemble import CHAT, StreamAssembler


def _req(**kw):
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_request_translation():
    chat = to_chat(_req(
        system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], stop_sequences=["\n"], top_k=5,
        metadata={"user_id": "u"}, seed=3, stream=True,
        tools=[{"name": "t", "input_schema": {"type": "object"}}], tool_choice={"type": "any",
                                                                                "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                    {"type": "text", "text": "ok"},
                                                    {"type": "tool_use", "id": "c1", "name": "t", "input": {"é": 1}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                                "content": [{"type": "text", "text": "r"}]}]}]))
    assert chat["messages"] == [
        {"role": "system", "content": "ab"},
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
        {"role": "assistant", "reasoning": "hm", "content": "ok", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "t", "arguments": '{"é": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["stop"], chat["top_k"]) == ("required", False,
                                                                                               ["\n"], 5)
    # extensions pass, Messages-only fields do not
    assert chat["seed"] == 3 and "metadata" not in chat
    assert chat["stream"] is True and chat["stream_options"]["include_usage"] is True


def test_request_translation_renders_as_vllms_own_messages_endpoint():
    """Where vLLM's ``/v1/messages`` (0.32) builds another prompt than a plain translation would: system
    blocks joined with nothing, without empty ones or Claude Code's billing-header block; empty text
    blocks and empty user turns left out; a tool result's images in a user message after it; a
    JSON-schema ``output_config`` constrains the answer."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    chat = to_chat(_req(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli;"},
                {"type": "text", "text": "You are"}, {"type": "text", "text": ""}, {"type": "text", "text": " terse."}],
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
        messages=[{"role": "user", "content": []},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
                                               {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "shot", "input": {}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "c1", "content": [
                          {"type": "text", "text": "1"}, {"type": "image", "source": {"type": "url", "url": "u"}},
                          {"type": "text", "text": "2"}]},
                      {"type": "text", "text": "next"}]}]))
    assert chat["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1\n2"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "user", "content": "next"}]
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    assert chat["reasoning_effort"] == "low" and "output_config" not in chat
    with pytest.raises(MessagesError, match="output_config.format"):
        to_chat(_req(output_config={"format": {"type": "text"}}))


def test_turns_reach_the_template_as_vllms_own_endpoint_hands_them():
    """vLLM's ``/v1/messages`` (0.32) hands a turn of several text blocks to the chat renderer as the
    list of parts (a template that iterates over content parts renders each; one joined by newlines
    rendered otherwise), renders thinking blocks as the turn's ``reasoning`` and gives a turn with no
    text no content (not ``""``, which such a template renders as one empty part). Before: the texts
    joined, thinking dropped, ``""``."""
    chat = to_chat(_req(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "one ", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "opaque"},
                                          {"type": "thinking", "thinking": "two", "signature": "s"},
                                          {"type": "text", "text": "5"}]},
        {"role": "user", "content": [{"type": "text", "text": "only"}, {"type": "text", "text": ""}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "tool_use", "id": "c", "name": "t", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": "1"}]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"}]},
        {"role": "user", "content": "go"}]))
    call = {"id": "c", "type": "function", "function": {"name": "t", "arguments": "{}"}}
    assert chat["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "reasoning": "one two", "content": "5"},
        {"role": "user", "content": "only"},
        {"role": "assistant", "reasoning": "hm", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "1"},
        {"role": "assistant"},
        {"role": "user", "content": "go"}]


def test_system_turns_inside_messages_stay_where_they_are():
    """A ``system`` turn in ``messages`` (a vLLM extension) is a system message in its place, as vLLM's
    endpoint sends it to a template that takes one anywhere; text blocks joined with nothing, the
    billing header and empty turns left out. An empty top-level ``system`` adds no system message
    (vLLM's endpoint adds none; an empty one still renders the template's system turn). Before: 400,
    and ``{"role": "system", "content": ""}``."""
    header = "x-anthropic-billing-header: cc_version=2.1; cch=1;"
    chat = to_chat(_req(system=[{"type": "text", "text": ""}], messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": header}, {"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]},
        {"role": "system", "content": header + "\nsecret hash line"}, {"role": "system", "content": ""},
        {"role": "user", "content": "again"}]))
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "system", "content": "ab"}, {"role": "user", "content": "again"}]
    assert to_chat(_req(system=""))["messages"] == [{"role": "user", "content": "hi"}]


def test_thinking_as_vllms_own_endpoint_reads_it():
    """``thinking`` enabled: its budget is the engine's ``thinking_token_budget`` (the reasoning is cut
    there; an engine without a reasoning parser refuses the call, as it refuses vLLM's own
    endpoint's); disabled: reasoning effort ``none`` (which turns a template's ``enable_thinking``
    off), over an ``output_config`` effort; adaptive: nothing. Before: dropped."""
    enabled = to_chat(_req(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"}))
    assert enabled["thinking_token_budget"] == 1024 and "reasoning_effort" not in enabled
    disabled = to_chat(_req(thinking={"type": "disabled"}, output_config={"effort": "high"}))
    assert disabled["reasoning_effort"] == "none" and "thinking_token_budget" not in disabled
    adaptive = to_chat(_req(thinking={"type": "adaptive"}, output_config={"effort": "high"}))
    assert adaptive["reasoning_effort"] == "high" and "thinking" not in adaptive


def test_tools_are_read_as_vllms_own_endpoint_reads_them():
    """``input_schema`` is required (vLLM's endpoint and Anthropic's answer 400 without it; the proxy
    made one up), a schema without ``type`` gets ``"type": "object"`` (after its keys, as vLLM
    adds it: a template that writes the tools as JSON shows it), ``strict`` and ``defer_loading``
    are kept (a strict tool constrains the call)."""
    chat = to_chat(_req(tools=[{"name": "a", "input_schema": {"properties": {"x": {"type": "string"}}}},
                               {"name": "b", "input_schema": {}, "strict": True, "defer_loading": False}]))
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "a", "parameters": {"properties": {"x": {"type": "string"}},
                                                                      "type": "object"}}},
        {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}, "strict": True,
                                          "defer_loading": False}}]
    assert list(chat["tools"][0]["function"]["parameters"]) == ["properties", "type"]


def _chat_answer(finish, stop_reason=None, args=None):
    msg = {"role": "assistant", "content": None if args is not None else ""}
    if args is not None:
        msg["tool_calls"] = [{"id": "c", "function": {"name": "t", "arguments": args}}]
    return {"id": "x", "choices": [{"finish_reason": finish, "stop_reason": stop_reason, "message": msg}]}


def _chunks(finish, stop_reason=None, args=None):
    delta = {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "t", "arguments": args}}]} \
        if args is not None else {}
    return [{"id": "x", "choices": [{"index": 0, "delta": delta}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": finish, "stop_reason": stop_reason}]}]


@pytest.mark.parametrize("finish, matched, args, want", [
    ("stop", None, '{"a": 1}', ("tool_use", None)),  # a named tool choice ends a whole call with "stop"
    ("stop", "}}", '{"a": {}}', ("tool_use", None)),  # a whole call cut by a stop string still runs
    ("stop", "}}", '{"a": {', ("stop_sequence", "}}")),  # one cut short does not
    ("length", None, '{"a": 1}', ("max_tokens", None)),
    ("tool_calls", None, '{"a": ', ("tool_use", None)),
    ("stop", None, None, ("end_turn", None)),
])
def test_stop_reason_as_vllms_messages_endpoint_gives_it(finish, matched, args, want):
    """(A JSON answer whose call does not decode fails there, as on vLLM's endpoint: only streamed
    arguments can be cut short.)"""
    if args is None or args.endswith("}"):
        msg = to_message(_chat_answer(finish, matched, args), "m", ["}}"])
        assert (msg["stop_reason"], msg["stop_sequence"]) == want
    else:
        with pytest.raises(AnswerError):
            to_message(_chat_answer(finish, matched, args), "m", ["}}"])
    translator = EventTranslator("m", ["}}"])
    raw = b"".join(b"".join(translator.chunk(c)) for c in _chunks(finish, matched, args))
    raw += b"".join(translator.finish())
    (delta,) = [d for e, d in _parse(raw) if e == "message_delta"]
    assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == want


def test_an_empty_answer_is_one_empty_text_block():
    """As vLLM and Anthropic give it: a client may read ``content[0].text`` (the SDK raised IndexError)."""
    assert to_message(_chat_answer("stop"), "m")["content"] == [{"type": "text", "text": ""}]


@pytest.mark.parametrize("bad, rule", [
    ([], "JSON object"), ({"max_tokens": 1, "messages": []}, "model"), (_req(max_tokens=0), "max_tokens"),
    (_req(max_tokens=-1), "max_tokens"), (_req(messages="hi"), "messages"),
    (_req(messages=[{"role": "tool", "content": "x"}]), "role"),
    (_req(messages=[{"role": "system", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]),
     r"messages\[0\].content\[0\]: expected a text block"),
    (_req(tools=[{"name": "t", "description": "no schema"}]), "input_schema"),
    (_req(tools=[{"name": "t", "input_schema": "{}"}]), "input_schema"),
    (_req(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1023}), "budget_tokens"),
    (_req(max_tokens=1024, thinking={"type": "enabled", "budget_tokens": 1024}), "budget_tokens"),
    (_req(max_tokens=2000, thinking={"type": "enabled"}), "budget_tokens"),
    (_req(thinking={"type": "sometimes"}), "thinking"),
    (_req(messages=[{"role": "user", "content": [{"type": "document"}]}]), "document"),
    (_req(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]),
     "tool_use"),
    (_req(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "custom tools"),
    (_req(tool_choice={"type": "sometimes"}), "tool_choice"), (_req(system=5), "system"),
    (_req(stop_sequences=[1]), "stop_sequences"),
])
def test_malformed_requests_name_the_rule(bad, rule):
    with pytest.raises(MessagesError, match=rule):
        to_chat(bad)


LAX = [  # (field, value): how vLLM's own /v1/messages (lax pydantic) reads values of other JSON types
    *[("stream", v) for v in ("false", "no", "0", "off", "true", "yes", 1, 0, 1.0, "maybe", 2, " true")],
    *[("max_tokens", v) for v in ("4096", 4096.0, " 4096 ", "4096.0", 4096.5, "1e3", "4k", [4096], True, "4_096",
                                  "\u00a04096\u2003", "\x1c4096", "0" * 4999 + "1", "1" * 4301, "-0" + "0" * 5000)],
    *[("budget_tokens", v) for v in ("2000", 1500.0, "1500.0", 1500.5, "2e3", "0" * 5000 + "2000")],
    *[("disable_parallel_tool_use", v) for v in ("false", "true", "no", 0, 1, "maybe", 2)],
]


def _both_read(body: dict, *, converted: bool = False) -> tuple:
    """(vLLM's reading of a Messages body, ours: ``to_chat``), each None where it refuses the body, and
    refused by both or neither. vLLM's: its request model, or with ``converted`` the chat request its
    own ``/v1/messages`` makes of it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    try:
        engine = AnthropicMessagesRequest.model_validate(json.loads(json.dumps(body)))
        engine = AnthropicServingMessages.to_chat_completion_request(engine) if converted else engine
    except ValueError:
        engine = None
    try:
        chat = to_chat(json.loads(json.dumps(body)))
    except MessagesError:
        chat = None
    assert (engine is None) == (chat is None), (engine, chat)
    return engine, chat


def _lax_body(field: str, value) -> dict:
    body = _req(max_tokens=4096)
    if field == "budget_tokens":
        body["thinking"] = {"type": "enabled", "budget_tokens": value}
    elif field == "disable_parallel_tool_use":
        body["tools"] = [{"name": "t", "input_schema": {"type": "object"}}]
        body["tool_choice"] = {"type": "auto", field: value}
    else:
        body[field] = value
    return body


@pytest.mark.parametrize("field, value", LAX, ids=[f"{f}={v!r:.24}" for f, v in LAX])
def test_request_values_are_read_as_vllms_own_messages_endpoint_reads_them(field, value):
    """A value vLLM's Messages endpoint reads (``stream: "false"``, ``max_tokens: "4096"``) is read the
    same way, and one it refuses is refused: ``stream: "false"`` was answered as an event stream where
    the engine answers JSON, and ``max_tokens: "4096"`` was refused where the engine answers."""
    engine, chat = _both_read(_lax_body(field, value))
    if engine is not None:
        no_parallel = getattr(engine.tool_choice, "disable_parallel_tool_use", None)
        read = (bool(engine.stream), engine.max_tokens, (engine.thinking.budget_tokens if engine.thinking else None),
                bool(no_parallel))
        assert read == (chat.get("stream", False), chat["max_tokens"], chat.get("thinking_token_budget"),
                        chat.get("parallel_tool_calls") is False)


_CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "calc", "input": {}}]}
_CALC = {"name": "calc", "input_schema": {"type": "object"}}


def _result(content=..., **kw) -> list[dict]:
    """A conversation whose last turn holds the calc call's tool_result with ``content``."""
    block = {"type": "tool_result", "tool_use_id": "t1", **({} if content is ... else {"content": content}), **kw}
    return [{"role": "user", "content": "hi"}, _CALL, {"role": "user", "content": [block]}]


ENGINE_SHAPES = {  # Messages conversations vLLM's own /v1/messages renders: the proxy sends the same turns
    "tool_result_text": _result("r"),
    "tool_result_missing": _result(),
    "tool_result_null": _result(None),
    "tool_result_parts": _result([{"type": "text", "text": "a"}, {"type": "text"}, {"type": "text", "text": "b"}]),
    "tool_search": _result([{"type": "tool_reference", "tool_name": "late"}]),  # Claude Code's tool search
    "tool_result_document": _result([{"type": "text", "text": "a"}, {"type": "document", "source": {"data": "d"}}]),
    "tool_reference_in_user_turn": [{"role": "user", "content": [{"type": "tool_reference", "tool_name": "calc"},
                                                                 {"type": "text", "text": "q"}]}],
    "ends_with_an_empty_user_turn": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure."},
                                     {"role": "user", "content": []}],
    "tool_reference_in_assistant_turn": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "ok"}, {"type": "tool_reference", "tool_name": "calc"}]},
        {"role": "user", "content": "go"}],
}


@pytest.mark.parametrize("name", list(ENGINE_SHAPES))
def test_conversations_are_sent_as_vllms_own_messages_endpoint_renders_them(name):
    """The chat request the proxy sends holds the turns vLLM's ``/v1/messages`` makes of the same
    Messages request. A tool_result naming tools (Claude Code's tool search) or holding a document,
    or with a null content, was refused (every later call of such a session failed); a conversation
    ending in an empty user turn was sent as a prefill of the assistant turn before it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = _req(tools=[_CALC, {**_CALC, "name": "late", "defer_loading": True}], messages=ENGINE_SHAPES[name])
    engine, chat = _both_read(body, converted=True)
    ours = ChatCompletionRequest.model_validate(chat)
    assert ours.model_dump(mode="json")["messages"] == engine.model_dump(mode="json")["messages"]
    assert (ours.continue_final_message, ours.add_generation_prompt) == (False, True)


OUTPUT_CONFIGS = [{"format": {"type": "json_schema", "schema": {}}}, {"format": {"type": "json_schema"}},
                  {"format": {"schema": {"type": "object"}}}, {"format": {"type": "json_schema", "schema": None}},
                  {"format": {"type": "text", "schema": {"type": "object"}}}, {"format": {"schema": "x"}},
                  {"effort": "none"}, {"effort": "minimal"}, {"effort": "max"}, {"effort": "high", "format": None}]


@pytest.mark.parametrize("config", OUTPUT_CONFIGS, ids=[json.dumps(c) for c in OUTPUT_CONFIGS])
def test_output_config_is_read_as_vllms_own_messages_endpoint_reads_it(config):
    """An empty schema constrains nothing there (it was sent as a JSON schema: the answer forced to
    JSON), a format without a type or schema is served (it was refused), and an effort it does not
    take ('none', 'minimal') is refused (it was served)."""
    engine, chat = _both_read(_req(output_config=config), converted=True)
    if engine is not None:
        fmt = engine.response_format
        assert (chat.get("response_format", {}).get("json_schema", {}).get("schema"), chat.get("reasoning_effort")) \
            == (fmt.json_schema.json_schema if fmt else None, engine.reasoning_effort)


def test_a_stop_string_that_cut_a_tool_call_is_the_stop_reason():
    """vLLM's ``/v1/messages`` reports a stop string that ended the answer inside a tool call (its
    arguments incomplete) as ``stop_sequence``: a call cut short must not run. The proxy said
    ``tool_use`` where the chat answer's finish reason was ``tool_calls`` (a streamed call). (A JSON
    answer with such a call fails there: test_anthropic_parity.)"""
    def streamed(args: str) -> dict:
        chunks = [{"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
                      {"index": 0, "id": "t", "function": {"name": "calc", "arguments": args}}]}}]},
                  {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls",
                                           "stop_reason": "STOP"}]}]
        translator = EventTranslator("m", ["STOP"])
        raw = b"".join(b"".join(translator.chunk(c)) for c in chunks) + b"".join(translator.finish())
        (delta,) = [d["delta"] for e, d in _parse(raw) if e == "message_delta"]
        return delta

    assert streamed('{"x": "1') == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    assert streamed('{"x": "1"}')["stop_reason"] == "tool_use"  # whole: it runs


def test_answer_translation():
    chat = {"id": "chatcmpl-1", "model": "asked", "usage": {"prompt_tokens": 5, "completion_tokens": 2},
            "choices": [{"finish_reason": "stop", "stop_reason": "END", "message": {
                "role": "assistant", "content": "hi", "tool_calls": [
                    {"id": "c", "function": {"name": "t", "arguments": '{"a": 1}'}},
                    {"id": "d", "function": {"name": "t", "arguments": '{"b": 2}'}}]}}]}
    msg = to_message(chat, "asked", ["END"])
    assert msg["id"] == "msg_chatcmpl-1" and (msg["stop_reason"], msg["stop_sequence"]) == ("tool_use", None)
    assert msg["content"] == [{"type": "text", "text": "hi"},
                              {"type": "tool_use", "id": "c", "name": "t", "input": {"a": 1}},
                              {"type": "tool_use", "id": "d", "name": "t", "input": {"b": 2}}]
    del chat["choices"][0]["message"]["tool_calls"]  # a stop string ended a text answer
    assert (to_message(chat, "asked", ["END"])["stop_sequence"]) == "END"
    assert msg["usage"] == {"input_tokens": 5, "output_tokens": 2}


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _parse(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_event_stream_from_chunks_split_anywhere():
    chunks = [{"id": "x", "model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 0},
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"content": "he"}}]},
              {"choices": [{"index": 0, "delta": {"content": "y"}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c",
                                                                  "function": {"name": "t", "arguments": '{"a"'}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
               "usage": {"prompt_tokens": 7, "completion_tokens": 4}}]
    raw = b"".join(_sse(c) for c in chunks) + b"data: [DONE]\n\n"
    stream = EventStream(lambda b: b, EventTranslator("asked"))
    out = b"".join(bytes(x) if not isinstance(x, list) else b"".join(x) for x in
                   [stream(raw[i:i + 7]) for i in range(0, len(raw), 7)] + [stream(b"")])
    events = _parse(out)
    assert [e for e, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                      "content_block_delta",
                                      "content_block_stop", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["model"] == "asked" and events[0][1]["message"]["usage"]["input_tokens"] == 7
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "c", "name": "t", "input": {}}
    assert "".join(d["delta"]["partial_json"] for e,
                   d in events if d.get("delta", {}).get("type") == "input_json_delta") == '{"a": 1}'
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use" and events[-2][1]["usage"]["output_tokens"] == 4
    # the native assembler folds the events it produced back into the message
    asm = MessageAssembler()
    for _, data in events:
        asm.add(data)
    msg = asm.result()
    assert asm.finished and msg["content"][0] == {"type": "text", "text": "hey"}
    assert msg["content"][1]["input"] == {"a": 1} and msg["stop_reason"] == "tool_use"


def test_a_streamed_answer_keeps_its_reasoning_as_the_json_answer_does():
    """Found by review: the stream dropped the thinking block that to_message keeps."""
    answer = {"id": "c", "model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": "think first", "content": "answer"}}]}
    chunks = [{"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "think "}}]},
              {"id": "c", "choices": [{"index": 0, "delta": {"reasoning_content": "first"}}]},
              {"id": "c", "choices": [{"index": 0, "delta": {"content": "answer"}, "finish_reason": "stop"}]}]
    raw = b"".join(_sse(c) for c in chunks) + b"data: [DONE]\n\n"
    stream = EventStream(lambda b: b, EventTranslator("m"))
    out = b"".join(bytes(x) if not isinstance(x, list) else b"".join(x) for x in (stream(raw), stream(b"")))
    asm = MessageAssembler()
    for _, data in _parse(out):
        asm.add(data)
    streamed, whole = asm.result()["content"], to_message(answer, "m")["content"]
    assert [{**b, "signature": None} for b in streamed] == [{**b, "signature": None} for b in whole]
    # signed as vLLM's /v1/messages signs a thinking block: a hex signature, streamed as the block's
    # last delta (a client that sends thinking back expects one)
    assert all(re.fullmatch("[0-9a-f]{32}", b[0]["signature"]) for b in (streamed, whole))
    kinds = [(e, d.get("delta", {}).get("type")) for e, d in _parse(out)]
    assert kinds[kinds.index(("content_block_stop", None)) - 1] == ("content_block_delta", "signature_delta")
    assert kinds.count(("content_block_delta", "signature_delta")) == 1


def test_stream_cut_short_ends_with_an_error_event():
    stream = EventStream(lambda b: b, EventTranslator("m"))
    out = stream(_sse({"choices": [{"index": 0, "delta": {"content": "a"}}]})) + stream(b"")
    assert [e for e, _ in _parse(out)][-1] == "error"


def test_error_shapes():
    assert error_from(400, {"error": {"message": "bad", "type": "BadRequestError"}}, None) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert error_from(503, {"object": "error", "message": "busy"}, None)["error"] == {"type": "overloaded_error",
                                                                                      "message": "busy"}
    assert error_from(502, None, "gateway down")["error"] == {"type": "api_error", "message": "gateway down"}
    native = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow"}}
    assert error_from(429, native, None) is native


# -- the first final event ends the answer ----------------------------------------------------------
def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion}


def _piece(i: int, content: str, finish=None, **extra) -> dict:
    return {"id": "x", "choices": [{"index": i, "delta": {"content": content}, "token_ids": [1],
                                    "finish_reason": finish}], **extra}


def _translated(raw: bytes, on_error=None) -> list[tuple[str, dict]]:
    stream = EventStream(lambda b: b, EventTranslator("m", on_error=on_error))
    return _parse(b"".join(bytes(x) if not isinstance(x, list) else b"".join(x) for x in (stream(raw), stream(b""))))


LATE = [_piece(0, " LATE"), _piece(0, " AGAIN", "length", usage=_usage(7, 9))]


@pytest.mark.parametrize("chunks, output_tokens", [
    ([_piece(0, "w0 ", usage=_usage(3, 1)), _piece(0, "w1", "stop", usage=_usage(3, 2)), *LATE], 2),
    ([_piece(0, "w0 "), _piece(0, "w1", "stop"), {"id": "x", "choices": [], "usage": _usage(3, 2)}, *LATE], 2),
    ([_piece(0, "w0 "), _piece(1, "x"), _piece(0, "w1", "stop", usage=_usage(3, 3)),
      _piece(1, "y", "length", usage=_usage(3, 4)), *LATE], 4),
    # continuous_usage_stats with n=2: each chunk holds its choice's running count, the usage-only chunk the total
    ([_piece(0, "w0 ", usage=_usage(3, 1)), _piece(1, "x", usage=_usage(3, 1)),
      _piece(0, "w1", "stop", usage=_usage(3, 2)), _piece(1, "y", "length", usage=_usage(3, 2)),
      {"id": "x", "choices": [], "usage": _usage(3, 4)}, *LATE,
      {"id": "x", "choices": [], "usage": _usage(3, 99)}], 4),
], ids=["usage-on-the-final-chunk", "usage-only-chunk-after-it", "another-choice-still-going", "running-counts"])
def test_the_translated_stream_ends_where_the_spans_answer_does(chunks, output_tokens):
    """What an upstream sent after choice 0's final chunk (more text, another finish reason and
    usage) reached the client up to [DONE] ("w0 w1 LATE AGAIN", max_tokens, 9 tokens) while the
    span's assembler ends the answer at that chunk: the client's message is now the span's answer,
    its usage the one the assembler keeps (given once every choice has ended)."""
    events = _translated(b"".join(_sse(c) for c in chunks) + b"data: [DONE]\n\n")
    assert [e for e, _ in events][-2:] == ["message_delta", "message_stop"]
    client = MessageAssembler()
    for _, data in events:
        client.add(data)
    span = StreamAssembler(CHAT)
    for c in chunks:
        span.add(c)
    want = ([{"type": "text", "text": "w0 w1"}], "end_turn", output_tokens)
    for msg in (client.result(), to_message(span.result(), "m")):
        assert (msg["content"], msg["stop_reason"], msg["usage"]["output_tokens"]) == want


def test_after_the_answer_only_an_error_reaches_the_client():
    """An error chunk after the final chunk still makes the span an error (the assembler counts it):
    the client hears of it too, as an error event after message_stop (the SDKs raise on one). A
    stream that ends without [DONE] after every choice ended is whole (the span says so): it got
    an error event instead of its message_delta."""
    seen: list[str] = []
    raw = b"".join(_sse(c) for c in [_piece(0, "w0", "stop", usage=_usage(3, 1)),
                                     {"error": {"message": "engine died"}}, _piece(0, " LATE")])
    assert [e for e, _ in _translated(raw, seen.append)][-3:] == ["message_delta", "message_stop", "error"]
    assert "engine died" in seen[0]
    events = _translated(_sse(_piece(0, "w0")) + _sse(_piece(0, "w1", "stop")))
    assert [e for e, _ in events][-2:] == ["message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"


def test_a_native_message_ends_with_message_stop():
    """What a hosted upstream sent after message_stop (more text, another stop reason and usage)
    was folded into the span's message ("hi LATE", max_tokens, 9 tokens); an error event after it
    still counts."""
    asm = MessageAssembler()
    for event in [{"type": "message_start", "message": {"id": "msg_1", "role": "assistant", "content": []}},
                  {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                  {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
                  {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
                  {"type": "message_stop"},
                  {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " LATE"}},
                  {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 9}}]:
        asm.add(event)
    msg = asm.result()
    assert (msg["content"], msg["stop_reason"], msg["usage"]) == ([{"type": "text", "text": "hi"}], "end_turn",
                                                                  {"output_tokens": 2})
    assert asm.error is None
    asm.add({"type": "error", "error": {"type": "overloaded_error", "message": "overloaded"}})
    assert "overloaded" in asm.error


_BASE = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _chunk(delta=None, finish=None, **choice) -> dict:
    return {**_BASE, "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish, **choice}]}


def _call(k, name=None, args="", id_=None) -> dict:
    fn = {"arguments": args} if name is None else {"name": name, "arguments": args}
    return {"tool_calls": [{"index": k, **({"id": id_, "type": "function"} if id_ else {}), "function": fn}]}


_STREAMS = {  # (after the role chunk vLLM sends first)
    "text inside an open tool call": [
        _chunk(_call(0, "f", "", "t1")), _chunk(_call(0, args='{"a"')), _chunk({"content": "hmm"}),
        _chunk(_call(0, args=": 1}"), "tool_calls")],
    "reasoning, text, two calls, text between them": [
        _chunk({"reasoning": "think"}), _chunk({"reasoning": " more"}), _chunk({"content": "I"}),
        _chunk(_call(0, "f", "{}", "t1")), _chunk({"content": " x"}), _chunk(_call(1, "g", '{"b": 2}', "t2")),
        _chunk({"content": "y"}, "tool_calls")],
    "reasoning then text": [_chunk({"reasoning": "a"}), _chunk({"content": "b"}, "stop")],
}


@pytest.mark.parametrize("name", list(_STREAMS))
def test_a_stream_is_translated_as_vllms_own_messages_endpoint_translates_it(name):
    """The events a harness gets for a streamed Messages call are vLLM's ``/v1/messages`` stream's
    (its converter, run offline on the same chat chunks), up to ids and signatures. Found by review:
    text arriving while a tool call was open closed the call's block and opened a text one, splitting
    the call; vLLM holds the text back for a block after the call."""
    import asyncio
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    chunks = [_chunk({"role": "assistant", "content": ""}), *_STREAMS[name], {**_BASE, "choices": [], "usage": usage}]

    async def engine_events() -> str:
        async def gen():
            for c in chunks:
                yield _sse(c).decode()
            yield "data: [DONE]\n\n"
        return "".join([e async for e in AnthropicServingMessages.message_stream_converter(None, gen())])

    def shape(raw: bytes) -> list:
        out = []
        for event, data in _parse(raw):
            data.pop("message", None)  # message_start: ids and usage differ by design
            block = data.get("content_block") or {}
            block.pop("id", None)
            if data.get("delta", {}).get("type") == "signature_delta" or block.get("type") == "thinking":
                data.get("delta", block).pop("signature", None)
            out.append((event, data))
        return out

    stream = EventStream(lambda b: b, EventTranslator("m"))
    ours = b"".join(bytes(x) if not isinstance(x, list) else b"".join(x) for x in (
        stream(b"".join(_sse(c) for c in chunks) + b"data: [DONE]\n\n"), stream(b"")))
    assert shape(ours) == shape(asyncio.run(engine_events()).encode())
