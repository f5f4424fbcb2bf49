"""Pure parts of the proxy (no mitmproxy): SSE relay, stream assembly, token fields, redaction, config."""

from __future__ import annotations

import json

import pytest

from lightning_harness.proxy.assemble import CHAT, COMPLETIONS, StreamAssembler, endpoint_of, token_fields
from lightning_harness.proxy.client import harness_env
from lightning_harness.proxy.config import ProxyConfig, parse_model_map
from lightning_harness.proxy.redact import MASK, Redactor, redact_obj
from lightning_harness.proxy.sse import SSERelay


def _ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_endpoint_of():
    assert endpoint_of("/v1/chat/completions?x=1") == CHAT
    assert endpoint_of("/openai/deployments/d/completions") == COMPLETIONS
    assert endpoint_of("/v1/models") is None and endpoint_of("/v1/embeddings") is None


def test_relay_passes_chunks_through_unchanged_when_not_rewriting():
    seen = []
    relay = SSERelay(seen.append)
    stream = _ev({"a": 1}) + _ev({"b": 2}) + b"data: [DONE]\n\n"
    pieces = [stream[i : i + 7] for i in range(0, len(stream), 7)]  # events split across chunks
    out = [relay(p) for p in pieces]
    assert out == pieces and seen == [{"a": 1}, {"b": 2}] and relay.done
    assert relay(b"") == []


def test_relay_rewrites_whole_events_and_never_returns_empty_bytes_mid_stream():
    relay = SSERelay(lambda o: None, [lambda o: o.pop("secret", None)])
    first = relay(b'data: {"x": 1, "secr')
    assert first == []  # a partial event waits; b"" would end the HTTP/1.1 body
    second = relay(b'et": 2}\r\n\r\ndata: [DONE]\r\n\r\n')
    assert second == b'data: {"x":1}\r\n\r\ndata: [DONE]\r\n\r\n'
    assert relay(b"") == []


def test_relay_reports_malformed_events_and_keeps_them():
    errors = []
    relay = SSERelay(lambda o: None, [lambda o: None], on_error=errors.append)
    assert relay(b"data: {nope\n\n") == b"data: {nope\n\n"
    assert errors and "malformed SSE event" in errors[0]


def test_assembles_chat_stream_with_tool_calls_and_token_ids():
    asm = StreamAssembler(CHAT)
    chunks = [
        {"id": "c1", "model": "m", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [5], "logprobs": {"content": [{"logprob": -0.5}]}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo", "tool_calls": [{"index": 0, "id": "t1", "function": {"name": "f", "arguments": "{\"a\""}}]}, "token_ids": [6], "logprobs": {"content": [{"logprob": -0.25}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls", "token_ids": [7], "logprobs": {"content": [{"logprob": -1.0}]}}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
    ]
    for c in chunks:
        asm.add(c)
    obj = asm.result()
    msg = obj["choices"][0]["message"]
    assert msg["content"] == "Hello" and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    f = token_fields(obj, CHAT)
    assert f["prompt_token_ids"] == [1, 2] and f["response_token_ids"] == [5, 6, 7]
    assert f["response_logprobs"] == [-0.5, -0.25, -1.0] and f["finish_reason"] == "tool_calls"
    assert (f["prompt_tokens"], f["completion_tokens"]) == (2, 3)


def test_token_fields_for_completions_json():
    obj = {"choices": [{"text": "ab", "prompt_token_ids": [9], "token_ids": [3, 4],
                        "logprobs": {"token_logprobs": [-0.1, None]}, "finish_reason": "stop"}]}
    f = token_fields(obj, COMPLETIONS)
    assert f["prompt_token_ids"] == [9] and f["response_token_ids"] == [3, 4]
    assert f["response_logprobs"][0] == -0.1 and f["response_logprobs"][1] != f["response_logprobs"][1]  # NaN
    assert (f["prompt_tokens"], f["completion_tokens"]) == (1, 2)
    assert token_fields(None, CHAT)["response_token_ids"] is None


def test_redaction():
    obj = {"api_key": "k", "nested": [{"Authorization": "Bearer x", "max_tokens": 5, "prompt_token_ids": [1]}], "x-api-key": "y"}
    assert redact_obj(obj) == {"api_key": MASK, "nested": [{"Authorization": MASK, "max_tokens": 5, "prompt_token_ids": [1]}], "x-api-key": MASK}
    r = Redactor(["proxy-token-123"])
    text = r.json_text(json.dumps({"messages": [{"content": "use sk-abcdefghijklmnop1234 and proxy-token-123"}], "password": "p"}))
    assert "sk-abcdef" not in text and "proxy-token-123" not in text and '"password": "[REDACTED]"' in text
    assert r.json_text('{"model": "m", "max_tokens": 3}') == '{"model": "m", "max_tokens": 3}'  # untouched
    assert r.path("/v1/chat/completions?api-version=1&api-key=abc") == f"/v1/chat/completions?api-version=1&api-key={MASK}"
    assert "s3cr3t" not in r.raw_text("api_key=s3cr3t&x=1")


def test_config_load_and_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("upstreams: [http://a:1/v1, {url: 'https://b', inject_token_ids: false}]\nroute_hosts: api.openai.com\n")
    cfg = ProxyConfig.load(f, forward_port=9, upstreams=None)
    assert [u.display for u in cfg.upstreams] == ["http://a:1", "https://b:443"]
    assert cfg.upstreams[1].inject_token_ids is False and cfg.route_hosts == ["api.openai.com"] and cfg.forward_port == 9
    with pytest.raises(ValueError, match="unknown proxy config keys"):
        ProxyConfig.from_mapping({"nope": 1})
    with pytest.raises(ValueError, match="NAME=SERVED"):
        parse_model_map(["bad"])
    with pytest.raises(ValueError, match="expected http"):
        ProxyConfig.from_mapping({"upstreams": ["ftp://x"]})
    with pytest.raises(ValueError, match="upstream 'http://h:notaport'"):
        ProxyConfig.from_mapping({"upstreams": ["http://h:notaport"]})
    f.write_text("- a\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        ProxyConfig.load(f)


def test_harness_env_without_token_uses_placeholder_segment():
    env = harness_env("r", 0, None, "http://h:1", "http://h:2", "/ca.pem")
    assert env["HTTP_PROXY"] == "http://r~0:-@h:1" and env["OPENAI_BASE_URL"] == "http://h:2/lh/r~0/-/v1"
    assert env["SSL_CERT_FILE"] == env["NODE_EXTRA_CA_CERTS"] == env["CURL_CA_BUNDLE"] == "/ca.pem"


@pytest.mark.parametrize("key", ["api_key", "apiKey", "x-api-key", "client_secret", "password", "Authorization",
                                 "access_token", "accessToken", "refresh_token", "id_token", "session_token",
                                 "cookie", "credentials", "private_key"])
def test_secret_keys_pass_the_fast_prefilter(key):
    """json_text only walks documents the substring prefilter flags: it must flag every secret key."""
    text = json.dumps({"outer": {key: "value-1234567"}})
    assert "value-1234567" not in Redactor().json_text(text)
    assert json.loads(Redactor().json_text(json.dumps({"token": "w0", "logprob": -1.0}))) == {"token": "w0", "logprob": -1.0}


def test_readme_config_example_loads(repo_root):
    import yaml

    text = (repo_root / "proxy" / "README.md").read_text()
    cfg = ProxyConfig.from_mapping(yaml.safe_load(text.split("```yaml\n")[1].split("```")[0]))
    assert len(cfg.upstreams) == 2 and cfg.model_map == {"gpt-4o": "policy"}
