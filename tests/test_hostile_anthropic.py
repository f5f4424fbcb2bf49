"""Hostile upstream answers: Anthropic Messages calls routed to the training pool, and the event
streams of every endpoint.

A real proxy process against a scripted upstream (raw HTTP bytes, so an answer can be anything a
broken or hostile server sends), real httpx, real Parquet. Found by review; each test failed first.
"""

from __future__ import annotations

import json

import httpx
import pytest
from fixtures_proxy import ScriptedUpstream, read_spans

from lightning_harness.proxy.anthropic import EventStream, EventTranslator
from lightning_harness.proxy.sse import SSERelay

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def aproxy(make_proxy, upstream):
    return make_proxy(upstreams=[upstream.url], route_hosts=["api.anthropic.com"])


def _post(p, rollout: str, body: dict, path: str = "/v1/messages") -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=20) as c:
        return c.post(p.env_for(rollout)["ANTHROPIC_BASE_URL"] + path, json=body,
                      headers={"x-api-key": "sk-lightning-placeholder", "anthropic-version": "2023-06-01"})


def _events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


REQ = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _chunk(delta: dict, finish=None, **extra) -> dict:
    return {"id": "c1", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                   "token_ids": [7]}], **extra}


def _done(events: list) -> list:
    return [*events, b"data: [DONE]\n\n"]


def _span(p, rollout: str) -> dict:
    (span,) = [s for s in read_spans(p) if s["rollout_id"] == rollout]
    return span


def test_a_stream_upstream_sent_with_content_length_reaches_the_client_whole(aproxy, upstream):
    """The translated events are not the bytes upstream counted: with its Content-Length kept, the
    client got the first 340 bytes (message_start, content_block_start) and no more."""
    upstream.sse(_done([_chunk({"role": "assistant", "content": "hello"}),
                        _chunk({}, "stop", usage={"prompt_tokens": 3, "completion_tokens": 1})]), length=True)
    r = _post(aproxy, "a-length", {**REQ, "stream": True})
    events = _events(r.text)
    assert [e for e, _ in events][-2:] == ["message_delta", "message_stop"]
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "hello"}
    assert _span(aproxy, "a-length")["error_kind"] is None


@pytest.mark.parametrize("odd", [{"usage": {"prompt_tokens": "x", "completion_tokens": [1]}},
                                 {"choices": 5}, {"choices": [{"index": 0, "delta": {"tool_calls": 7}}]},
                                 {"choices": [{"index": 0, "delta": {"content": "\ud800"}, "finish_reason": []}]}],
                         ids=["usage", "choices", "tool_calls", "surrogate"])
def test_a_stream_chunk_of_an_odd_shape_does_not_leave_the_client_hanging(aproxy, upstream, odd):
    """An exception in the translator went up into mitmproxy: the client waited, unanswered, until
    its own timeout (the span then said client_disconnect)."""
    upstream.sse(_done([_chunk({"role": "assistant", "content": "hi"}), {"id": "c1", **odd}, _chunk({}, "stop")]))
    r = _post(aproxy, "a-odd", {**REQ, "stream": True})
    events = _events(r.text)
    assert [e for e, _ in events][-1] == "message_stop" and events[2][1]["delta"]["text"] == "hi"
    assert _span(aproxy, "a-odd")["stream"] is True  # recorded (capture judges the odd shape itself)


def test_a_json_answer_of_an_odd_shape_is_still_a_message(aproxy, upstream):
    """to_message raised: the client got the chat completion itself, not a Messages answer."""
    upstream.json({"id": "c1", "usage": {"prompt_tokens": "x"}, "choices": [{"index": 0, "finish_reason": [],
                   "token_ids": [1], "message": {"role": "assistant", "content": "a\ud800",
                                                 "tool_calls": ["x", {"id": 5, "function": {"name": 6}}]}}]})
    r = _post(aproxy, "a-json", REQ)
    msg = r.json()
    assert msg["type"] == "message" and msg["content"][0] == {"type": "text", "text": "a\ud800"}
    assert msg["content"][1]["name"] == "" and msg["content"][1]["id"].startswith("toolu_")
    # a finish reason vLLM's /v1/messages does not map has no stop reason there
    assert msg["usage"] == {"input_tokens": 0, "output_tokens": 0} and msg["stop_reason"] is None


def test_a_trailing_slash_still_reaches_chat_completions(aproxy, upstream):
    """``/v1/messages/`` was sent upstream as ``/v1/mchat/completions``."""
    upstream.json({"id": "c1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                            "finish_reason": "stop", "token_ids": [1]}]})
    r = _post(aproxy, "a-slash", REQ, path="/v1/messages/")
    assert r.json()["content"] == [{"type": "text", "text": "x"}]
    assert upstream.paths == ["/v1/chat/completions"]


def test_an_error_event_mid_stream_ends_the_stream_and_the_span_says_so(aproxy, upstream):
    """The span was a clean answer (error_kind None, finish_reason 'stop', every token id) while the
    client got an error event, then more deltas after it."""
    upstream.sse(_done([_chunk({"role": "assistant", "content": "hello"}),
                        {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}},
                        _chunk({"content": " more"}), _chunk({}, "stop")]))
    r = _post(aproxy, "a-err", {**REQ, "stream": True})
    events = _events(r.text)
    assert [e for e, _ in events][-1] == "error" and events[-1][1]["error"]["message"] == "engine died"
    span = _span(aproxy, "a-err")
    assert span["error_kind"] is not None and "engine died" in span["error"]


@pytest.mark.parametrize("own", [False, True], ids=["prefill", "harness-says"])
def test_a_last_assistant_message_is_continued(aproxy, upstream, own):
    """Messages: a last assistant turn is a prefill the answer continues. It was sent as a finished
    turn followed by a new one (the chat default): the model answered anew, not from the prefill."""
    upstream.json({"id": "c1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                            "finish_reason": "stop", "token_ids": [1]}]})
    body = {**REQ, "messages": [{"role": "user", "content": "json please"}, {"role": "assistant", "content": "{"}]}
    _post(aproxy, "a-pre", {**body, **({"continue_final_message": False} if own else {})})
    sent = upstream.bodies[-1]
    assert (sent["continue_final_message"], sent["add_generation_prompt"]) == (not own, False)
    _post(aproxy, "a-pre", REQ)
    assert "continue_final_message" not in upstream.bodies[-1]


def test_a_translator_bug_becomes_an_error_event_not_an_exception():
    class Broken(EventTranslator):
        def chunk(self, obj):
            raise KeyError("boom")
            yield b""

    seen = []
    stream = EventStream(lambda b: b, Broken("m", on_error=seen.append))
    out = stream(b'data: {"choices": []}\n\n')
    assert [e for e, _ in _events(out.decode())] == ["error"] and "KeyError" in seen[0]


def test_a_native_stream_keeps_the_thinking_signature(aproxy):
    """A Messages stream not routed to the pool is recorded as upstream sent it; the thinking block's
    ``signature_delta`` was dropped (the span's block had ``signature: ""``)."""
    events = [("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                             "usage": {"input_tokens": 3, "output_tokens": 0}}}),
              ("content_block_start", {"index": 0, "content_block": {"type": "thinking", "thinking": "",
                                                                     "signature": ""}}),
              ("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": "hm"}}),
              ("content_block_delta", {"index": 0, "delta": {"type": "signature_delta", "signature": "SIG"}}),
              ("content_block_stop", {"index": 0}), ("ping", {}),
              ("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}}),
              ("message_stop", {})]
    hosted = ScriptedUpstream()  # not the pool: forwarded untouched, recorded natively
    hosted.sse([f"event: {n}\ndata: {json.dumps({'type': n, **d})}\n\n".encode() for n, d in events])
    env = aproxy.env_for("a-native")
    with httpx.Client(proxy=env["HTTP_PROXY"], timeout=20) as c:
        r = c.post(hosted.url + "/v1/messages", json={**REQ, "stream": True})
    hosted.close()
    assert _events(r.text)[3][1]["delta"]["signature"] == "SIG"  # relayed as sent
    span = _span(aproxy, "a-native")
    assert span["error_kind"] is None and span["token_ids_injected"] is False
    assert json.loads(span["response_json"])["content"] == [{"type": "thinking", "thinking": "hm", "signature": "SIG"}]


def test_an_event_past_max_decoded_size_is_not_buffered_whole(make_proxy, upstream):
    """The relay stops parsing an event past max_decoded_size (memory), but the Messages stream
    around it buffered the whole event anyway (40 MiB held for a 1 MiB bound) and translated it."""
    p = make_proxy(upstreams=[upstream.url], extra_args=["--max-decoded-size", str(1 << 20)])
    upstream.sse(_done([_chunk({"role": "assistant", "content": "hi"}), _chunk({"content": "x" * (3 << 20)}),
                        _chunk({}, "stop")]))
    r = _post(p, "a-big", {**REQ, "stream": True})
    events = _events(r.text)
    assert [e for e, _ in events][-1] == "error" and "max_decoded_size" in events[-1][1]["error"]["message"]
    assert len(r.content) < 1 << 20
    assert _span(p, "a-big")["error_kind"] == "too_large"


def test_the_event_stream_keeps_at_most_one_bounded_event():
    relay = SSERelay(lambda e: None, [], max_event=1 << 20)
    stream = EventStream(relay, EventTranslator("m"), max_event=relay.max_event)
    stream(b'data: {"choices": [{"index": 0, "delta": {"content": "')
    for _ in range(8):
        stream(b"x" * (1 << 20))
    assert relay.oversize and len(stream.buf) <= 1 << 20


def _native_span(p, rollout: str, path: str, events: list[bytes], body: dict) -> dict:
    """Send ``body`` through the forward proxy to a hosted (not routed) upstream streaming ``events``."""
    hosted = ScriptedUpstream()
    hosted.sse(events)
    with httpx.Client(proxy=p.env_for(rollout)["HTTP_PROXY"], timeout=20) as c:
        c.post(hosted.url + path, json=body)
    hosted.close()
    return _span(p, rollout)


def _named(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def test_an_error_event_in_any_endpoints_stream_makes_an_error_span(aproxy, upstream):
    """vLLM sends an error chunk when generation fails mid-way, then [DONE]; a chat stream with one
    was recorded as a clean answer (its token ids trained on), as were a Responses stream that
    failed and a native Messages stream with an error event."""
    upstream.sse(_done([_chunk({"role": "assistant", "content": "hel"}),
                        {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}]))
    with httpx.Client(trust_env=False, timeout=20) as c:
        c.post(aproxy.env_for("c-err")["OPENAI_BASE_URL"] + "/chat/completions",
               json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    chat = _span(aproxy, "c-err")
    failed = {"id": "resp_1", "object": "response", "status": "failed", "output": [],
              "error": {"code": "server_error", "message": "engine died too"}}
    event = b"data: " + json.dumps({"type": "response.failed", "response": failed}).encode() + b"\n\n"
    responses = _native_span(aproxy, "r-err", "/v1/responses", [event], {"model": "m", "input": "hi", "stream": True})
    messages = _native_span(aproxy, "m-err", "/v1/messages", [
        _named("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "content": []}}),
        _named("error", {"error": {"type": "overloaded_error", "message": "overloaded"}})], {**REQ, "stream": True})
    for span, said in ((chat, "engine died"), (responses, "engine died too"), (messages, "overloaded")):
        assert span["error_kind"] == "malformed_response" and said in span["error"], span["error"]


def test_a_stripped_chat_stream_upstream_sent_with_content_length_reaches_the_client_whole(aproxy, upstream):
    """The injected token ids are stripped from each event, so the events sent are fewer bytes than
    upstream's Content-Length: the client failed with 'peer closed connection without sending
    complete message body (received 244 bytes, expected 304)'."""
    upstream.sse(_done([_chunk({"role": "assistant", "content": "hello"}), _chunk({"content": " world"}, "stop")]),
                 length=True)
    with httpx.Client(trust_env=False, timeout=20) as c:
        r = c.post(aproxy.env_for("c-len")["OPENAI_BASE_URL"] + "/chat/completions",
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert r.status_code == 200 and "[DONE]" in r.text and " world" in r.text and '"token_ids":[' not in r.text
    assert _span(aproxy, "c-len")["error_kind"] is None


def _client_answer(events: list[tuple[str, dict]]) -> tuple[str, str, int]:
    """(text, stop reason, output tokens) of a Messages stream as a client reads it."""
    text = "".join(d["delta"].get("text", "") for e, d in events if e == "content_block_delta")
    (delta,) = [d for e, d in events if e == "message_delta"]
    return text, delta["delta"]["stop_reason"], delta["usage"]["output_tokens"]


def test_a_translated_stream_ends_with_its_final_chunk(aproxy, upstream):
    """An upstream that streams on after choice 0's final chunk (more text, another finish reason
    and usage, then [DONE]): the Messages client got "w0 w1 LATE AGAIN", max_tokens, 9 tokens,
    while the span recorded "w0 w1", stop, 2 tokens. Both now hold the answer the final chunk ended."""
    upstream.sse(_done([_chunk({"role": "assistant", "content": "w0 "}),
                        _chunk({"content": "w1"}, "stop", usage={"prompt_tokens": 3, "completion_tokens": 2}),
                        _chunk({"content": " LATE"}),
                        _chunk({"content": " AGAIN"}, "length", usage={"prompt_tokens": 7, "completion_tokens": 9})]))
    r = _post(aproxy, "a-late", {**REQ, "stream": True})
    events = _events(r.text)
    assert _client_answer(events) == ("w0 w1", "end_turn", 2) and events[-1][0] == "message_stop"
    span = _span(aproxy, "a-late")
    choice = json.loads(span["response_json"])["choices"][0]
    assert (span["error_kind"], choice["message"]["content"], span["finish_reason"], span["completion_tokens"]) == (
        None, "w0 w1", "stop", 2)


NATIVE_ANSWER = [
    _named("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                         "usage": {"input_tokens": 3, "output_tokens": 0}}}),
    _named("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    _named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
    _named("content_block_stop", {"index": 0}),
    _named("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}}),
    _named("message_stop", {})]
NATIVE_LATE = [_named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": " LATE"}}),
               _named("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 9}}),
               _named("message_stop", {})]


def test_a_native_stream_ends_with_message_stop(aproxy):
    """A hosted upstream that streams on after message_stop (more text, another stop reason and
    usage): the span recorded "hi LATE", max_tokens, 9 output tokens; now the message message_stop
    ended. An error event after it still makes the span an error (the SDKs raise on it)."""
    span = _native_span(aproxy, "m-late", "/v1/messages", NATIVE_ANSWER + NATIVE_LATE, {**REQ, "stream": True})
    msg = json.loads(span["response_json"])
    assert (span["error_kind"], msg["content"], span["finish_reason"], span["completion_tokens"]) == (
        None, [{"type": "text", "text": "hi"}], "end_turn", 2)
    error = _named("error", {"error": {"type": "overloaded_error", "message": "overloaded"}})
    span = _native_span(aproxy, "m-late-err", "/v1/messages", [*NATIVE_ANSWER, error], {**REQ, "stream": True})
    assert span["error_kind"] == "malformed_response" and "overloaded" in span["error"]


def test_a_tool_call_whose_arguments_are_not_json_fails_as_on_vllms_own_endpoint(aproxy, upstream):
    """vLLM's ``/v1/messages`` fails an answer whose tool call arguments do not decode (a named tool
    call cut by max_tokens) with HTTP 400; the proxy answered 200 with ``input: {}``, a call the
    harness would run with no arguments. Its span is an error (the harness never got the answer it
    records), never trained on."""
    upstream.json({"id": "c1", "usage": {"prompt_tokens": 3, "completion_tokens": 4}, "choices": [{
        "index": 0, "finish_reason": "length", "token_ids": [1, 2, 3, 4], "message": {
            "role": "assistant", "content": None, "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2+'}}]}}]})
    r = _post(aproxy, "a-badargs", REQ)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and "Unterminated string" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"  # (the type every 400 of the proxy's Messages has)
    span = _span(aproxy, "a-badargs")
    assert span["error_kind"] == "malformed_response" and "HTTP 400" in span["error"], span["error"]
    assert span["status_code"] == 400  # what the harness got, as the column says
