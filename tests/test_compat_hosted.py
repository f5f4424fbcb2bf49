"""The official `openai` Python client written for a hosted provider (explicit https base URL and the
provider's model name), routed to the training upstream with only the printed environment; plus an
agent-framework-like client that uses tools and ``stream_options.include_usage``."""

from __future__ import annotations

import json

import pytest
from fixtures_compat import client_env, python_client, run_client
from fixtures_proxy import read_spans

pytestmark = pytest.mark.timeout(300)

HOSTED = "https://api.hosted-llm.test/v1"


@pytest.fixture
def hosted_proxy(make_proxy):
    return make_proxy(route_hosts=["api.hosted-llm.test"], model_map={"hosted-large": "policy"})


@pytest.mark.parametrize("how", ["json", "stream"])
def test_hosted_model_name_is_mapped_and_mapped_back(hosted_proxy, stub_server, how):
    out = run_client(python_client("openai_hosted.py", HOSTED, "hosted-large", how),
                     client_env(hosted_proxy.env_for("hosted")))
    assert out["content"] == "w0 w1 w2 w3 "
    # the harness gets back the model name it asked for, not the served one
    assert (out["model"] if how == "json" else out["models"]) == ("hosted-large" if how == "json" else ["hosted-large"])
    assert out["extra"] == [] and (how != "json" or out["logprobs"] is None)
    assert stub_server.requests()[-1]["model"] == "policy"
    (span,) = read_spans(hosted_proxy)
    assert (span["mode"], span["scheme"], span["host"]) == ("forward", "https", "api.hosted-llm.test")
    assert (span["model"], span["served_model"]) == ("hosted-large", "policy")
    assert json.loads(span["response_json"])["model"] == "policy"  # as upstream answered
    assert span["response_token_ids"] == [100, 101, 102, 103] and span["stream"] is (how == "stream")


@pytest.mark.parametrize("how", ["tools", "tools-stream"])
def test_agent_tools_and_include_usage(hosted_proxy, how):
    out = run_client(python_client("openai_hosted.py", HOSTED, "hosted-large", how),
                     client_env(hosted_proxy.env_for("agent")))
    (call,) = out["tool_calls"]
    assert call["id"] == "call_stub_0" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"arg": "w0 w1 w2 w3 "}
    assert out["finish_reason"] == "tool_calls" and out["extra"] == []
    if how == "tools-stream":
        assert out["usage"]["completion_tokens"] == 4 and out["models"] == ["hosted-large"]
    (span,) = read_spans(hosted_proxy)
    req = json.loads(span["request_json"])
    assert req["tools"][0]["function"]["name"] == "get_weather" and req["tool_choice"] == "auto"
    resp = json.loads(span["response_json"])
    tc = resp["choices"][0]["message"]["tool_calls"][0]
    assert tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"arg": "w0 w1 w2 w3 "}
    assert span["finish_reason"] == "tool_calls" and span["response_token_ids"] == [100, 101, 102, 103]
    assert span["completion_tokens"] == 4 and span["prompt_tokens"] is not None
    assert span["response_logprobs"] == pytest.approx([-0.01, -0.02, -0.03, -0.04])
