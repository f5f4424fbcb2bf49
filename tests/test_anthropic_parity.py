"""Answers translated as vLLM's own ``/v1/messages`` (0.32) gives them, its converters run offline on
the same chat answer as the oracle: the stop reason of every finish reason, streamed tool calls
whose id comes before their name, and JSON answers whose tool call arguments do not decode."""

from __future__ import annotations

import asyncio
import json
import warnings

import pytest

from lightning_harness.proxy.anthropic import AnswerError, EventStream, EventTranslator, to_message

USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
BASE = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _engine():
    """vLLM's Messages serving class (its converters use nothing of the instance)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    return AnthropicServingMessages


def _engine_answer(chat: dict) -> tuple[int, dict]:
    """(status, body) vLLM's endpoint gives for a chat answer: its JSON converter's message, or the
    error its router makes of the exception the converter raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    try:
        message = _engine().messages_full_converter(None, ChatCompletionResponse.model_validate(chat))
    except Exception as exc:
        error = create_error_response(exc).error
        return error.code, {"type": "error", "error": {"type": error.type, "message": error.message}}
    return 200, message.model_dump(mode="json", exclude_none=True)


def _our_answer(chat: dict) -> tuple[int, dict]:
    try:
        return 200, to_message(json.loads(json.dumps(chat)), "m")
    except AnswerError as exc:
        return exc.status, {"type": "error", "error": {"message": str(exc)}}


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _events(raw: bytes) -> list[tuple[str, dict]]:
    """The events of a Messages stream, without what differs by design (the message_start's ids and
    usage, thinking signatures)."""
    out = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data[len("data: "):])
        event.pop("message", None)
        if event.get("delta", {}).get("type") == "signature_delta":
            event["delta"].pop("signature")
        out.append((name[len("event: "):], event))
    return out


def _both_streams(chunks: list[dict]) -> tuple[list, list]:
    """(vLLM's events, ours) for the same chat chunks: the role chunk vLLM sends first, ``chunks``,
    the usage-only chunk and ``[DONE]``."""
    chunks = [{**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, *chunks,
              {**BASE, "choices": [], "usage": USAGE}]
    raw = b"".join(_sse(c) for c in chunks) + b"data: [DONE]\n\n"

    async def engine() -> str:
        async def gen():
            for c in chunks:
                yield _sse(c).decode()
            yield "data: [DONE]\n\n"
        return "".join([e async for e in _engine().message_stream_converter(None, gen())])

    stream = EventStream(lambda b: b, EventTranslator("m"))
    ours = b"".join(bytes(x) if not isinstance(x, list) else b"".join(x) for x in (stream(raw), stream(b"")))
    return _events(asyncio.run(engine()).encode()), _events(ours)


def _chunk(delta: dict, finish=None) -> dict:
    return {**BASE, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


FINISHES = ["stop", "length", "tool_calls", "abort", "repetition", "content_filter", "function_call", "error"]
CALL = {"id": "t1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2+3"}'}}


@pytest.mark.parametrize("with_call", [False, True], ids=["text", "tool_call"])
@pytest.mark.parametrize("finish", FINISHES)
def test_every_finish_reason_has_the_stop_reason_vllms_endpoint_gives(finish, with_call):
    """``abort`` (an engine that stopped the answer), ``repetition`` and any other finish reason vLLM's
    ``/v1/messages`` does not map have no stop reason there (null); the proxy said ``end_turn``
    (``refusal`` for ``content_filter``), a finished turn, in the JSON answer and in the stream."""
    message = {"role": "assistant", "content": "hi", **({"tool_calls": [CALL]} if with_call else {})}
    chat = {**BASE, "object": "chat.completion", "usage": USAGE,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
    (status, engine), (_, ours) = _engine_answer(chat), _our_answer(chat)
    assert status == 200
    assert (ours["stop_reason"], ours["stop_sequence"]) == (engine.get("stop_reason"), engine.get("stop_sequence"))
    pieces = [_chunk({"content": "hi"})]
    if with_call:
        pieces.append(_chunk({"tool_calls": [{"index": 0, **CALL}]}))
    engine_events, our_events = _both_streams([*pieces, _chunk({}, finish)])
    assert [d for e, d in our_events if e == "message_delta"] == [d for e, d in engine_events if e == "message_delta"]


def _call_delta(**piece) -> dict:
    return {"tool_calls": [{"index": 0, **piece}]}


ID_FIRST = {  # streamed tool calls whose id comes in a delta of its own, before (or without) the name
    "id, then name and arguments": [
        _chunk(_call_delta(id="t1", type="function")), _chunk(_call_delta(function={"name": "calc"})),
        _chunk(_call_delta(function={"arguments": '{"expr": "2+3"}'}), "tool_calls")],
    "id with arguments, no name": [
        _chunk({"content": "Let me see."}), _chunk(_call_delta(id="t1", function={"arguments": '{"a"'})),
        _chunk(_call_delta(function={"arguments": ": 1}"})), _chunk({"content": " Done."}, "tool_calls")],
    "id, then the id again with the name": [
        _chunk(_call_delta(id="t1", type="function")),
        _chunk(_call_delta(id="t1", function={"name": "calc", "arguments": "{}"}), "tool_calls")],
    "a second call named, the first not": [
        _chunk(_call_delta(id="t1", type="function")),
        _chunk({"tool_calls": [{"index": 1, "id": "t2", "function": {"name": "calc", "arguments": "{}"}}]}),
        _chunk(_call_delta(function={"arguments": '{"x": 1}'}), "tool_calls")],
    "an empty name": [_chunk(_call_delta(id="t1", function={"name": "", "arguments": "{}"}), "tool_calls")],
}


@pytest.mark.parametrize("name", list(ID_FIRST))
def test_a_streamed_tool_call_named_after_its_id_is_read_as_vllms_endpoint_reads_it(name):
    """vLLM's ``/v1/messages`` opens a ``tool_use`` block only for a delta with both an id and a name
    (a call never named so is left out, its arguments with it); the proxy opened one at the id with
    ``name: ""``, a call no client can run, and streamed its arguments into it."""
    engine, ours = _both_streams(ID_FIRST[name])
    assert ours == engine


ARGUMENTS = ['{"expr": "2+', "not json", "", "[1, 2]", "5", '"text"', "true", "null", '{"expr": "2+3"}', "{}",
             '{"a":' * 100_000]


@pytest.mark.parametrize("arguments", ARGUMENTS, ids=[repr(a)[:16] for a in ARGUMENTS])
def test_a_json_answer_whose_tool_arguments_do_not_decode_fails_as_on_vllms_endpoint(arguments):
    """vLLM's ``/v1/messages`` decodes each call's arguments into ``input``: text that is not JSON
    fails the call there (HTTP 400, the decoder's message; 500 if nested too deep to decode), as
    does JSON that is not an object; the
    proxy answered ``input: {}``, a call the harness would run without its arguments. (A null
    ``input`` is no ``input`` there.)"""
    message = {"role": "assistant", "content": None,
               "tool_calls": [{**CALL, "function": {"name": "calc", "arguments": arguments}}]}
    chat = {**BASE, "object": "chat.completion", "usage": USAGE,
            "choices": [{"index": 0, "message": message, "finish_reason": "length"}]}
    (status, engine), (our_status, ours) = _engine_answer(chat), _our_answer(chat)
    assert our_status == status
    if status == 200:
        assert (ours["content"], ours["stop_reason"]) == (engine["content"], engine["stop_reason"])
    elif "validation error" not in engine["error"]["message"]:  # (pydantic's wording is vLLM's own)
        assert engine["error"]["message"] in ours["error"]["message"]
