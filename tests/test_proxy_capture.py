"""Capture through a real mitmproxy process with the official openai client configured by env only."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fixtures_proxy import StubServer, read_spans

pytestmark = pytest.mark.timeout(300)

MSG = [{"role": "user", "content": "hello"}]


def test_reverse_mode_json_with_token_ids(proxy, openai_from_env, stub_server):
    client = openai_from_env(proxy.env_for("rev-1", 2))
    r = client.chat.completions.create(model="policy", messages=MSG, max_tokens=5)
    assert r.choices[0].message.content == "w0 w1 w2 w3 w4 "
    # the harness did not ask for token ids or logprobs: it must not see them (null, as plain vLLM says)
    raw = json.loads(r.model_dump_json())
    assert raw["choices"][0]["logprobs"] is None
    assert raw["prompt_token_ids"] is None and raw["choices"][0]["token_ids"] is None
    # the upstream was asked for them
    sent = stub_server.requests()[-1]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert "_auth" in sent and "sk-lightning-placeholder" in (sent["_auth"] or "")
    (span,) = read_spans(proxy)
    assert (span["rollout_id"], span["attempt"], span["seq"]) == ("rev-1", 2, 0)
    assert span["mode"] == "reverse" and span["endpoint"] == "chat.completions"
    assert span["path"] == "/v1/chat/completions"  # credentials stripped from the path
    assert span["response_token_ids"] == [100, 101, 102, 103, 104]
    assert span["prompt_token_ids"] == list(b"hello")
    assert span["response_logprobs"] == pytest.approx([-0.01, -0.02, -0.03, -0.04, -0.05])
    assert span["finish_reason"] == "length" and span["n_choices"] == 1
    assert span["prompt_tokens"] == 5 and span["completion_tokens"] == 5
    assert span["token_ids_injected"] is True and span["error_kind"] is None
    assert span["status_code"] == 200 and span["stream"] is False
    assert json.loads(span["request_json"])["messages"] == MSG
    assert "return_token_ids" not in span["request_json"]  # recorded as the harness sent it
    assert json.loads(span["response_json"])["choices"][0]["token_ids"] == [100, 101, 102, 103, 104]
    assert span["latency_ms"] > 0 and span["ttft_ms"] is not None and span["ended_at"] >= span["started_at"]
    assert span["upstream"] == stub_server.url


def test_harness_that_asks_for_logprobs_keeps_them(proxy, openai_from_env):
    client = openai_from_env(proxy.env_for("rev-lp"))
    r = client.chat.completions.create(model="policy", messages=MSG, max_tokens=3, logprobs=True)
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx([-0.01, -0.02, -0.03])
    assert r.model_dump()["choices"][0]["token_ids"] is None  # not asked: null, as plain vLLM says
    (span,) = read_spans(proxy)
    assert span["response_token_ids"] == [100, 101, 102]


def test_forward_http_routes_hosted_model_to_pool(make_proxy, openai_from_env, stub_server):
    p = make_proxy(route_hosts=["api.example-llm.test"], served_model="policy-v", model_map={"gpt-x": "mapped"})
    env = p.env_for("fwd-http", 0)
    env["OPENAI_BASE_URL"] = "http://api.example-llm.test/v1"  # a harness pointed at some hosted model
    client = openai_from_env(env)
    r1 = client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
    r2 = client.completions.create(model="gpt-x", prompt="abc", max_tokens=3)
    assert r1.choices[0].message.content == "w0 w1 " and r2.choices[0].text == "w0 w1 w2 "
    assert r2.choices[0].logprobs is None
    sent = stub_server.requests()[-2:]
    assert [s["model"] for s in sent] == ["policy-v", "mapped"]
    assert sent[1]["logprobs"] == 0 and sent[1]["return_token_ids"] is True
    s1, s2 = read_spans(p)
    assert (s1["seq"], s2["seq"]) == (0, 1)
    assert s1["mode"] == "forward" and s1["scheme"] == "http" and s1["host"] == "api.example-llm.test"
    assert (s1["model"], s1["served_model"]) == ("gpt-4o", "policy-v")
    assert (s2["model"], s2["served_model"], s2["endpoint"]) == ("gpt-x", "mapped", "completions")
    assert s2["response_token_ids"] == [100, 101, 102] and s2["prompt_token_ids"] == list(b"abc")
    assert s2["response_logprobs"] == pytest.approx([-0.01, -0.02, -0.03])


def test_forward_https_intercepted_streaming(proxy, openai_from_env):
    env = proxy.env_for("fwd-https", 1)
    env["OPENAI_BASE_URL"] = "https://api.openai.com/v1"  # TLS, trusted only through SSL_CERT_FILE
    client = openai_from_env(env)
    stream = client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=4, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "w0 w1 w2 w3 "
    for c in chunks:  # injected fields stripped from every event the harness sees
        d = c.model_dump()
        assert "prompt_token_ids" not in d
        for ch in d["choices"]:
            assert ch.get("logprobs") is None and "token_ids" not in ch
    (span,) = read_spans(proxy)
    assert span["scheme"] == "https" and span["host"] == "api.openai.com" and span["stream"] is True
    assert span["response_token_ids"] == [100, 101, 102, 103]
    assert span["response_logprobs"] == pytest.approx([-0.01, -0.02, -0.03, -0.04])
    assert span["prompt_token_ids"] == list(b"hello") and span["finish_reason"] == "length"
    assembled = json.loads(span["response_json"])
    assert assembled["choices"][0]["message"]["content"] == "w0 w1 w2 w3 "


def test_streaming_completions_with_usage(proxy, openai_from_env):
    client = openai_from_env(proxy.env_for("cmpl-stream"))
    stream = client.completions.create(
        model="m", prompt="xyz", max_tokens=3, stream=True, logprobs=1, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "w0 w1 w2 "
    assert [c.choices[0].logprobs.token_logprobs for c in chunks if c.choices] == [[-0.01], [-0.02], [-0.03]]
    (span,) = read_spans(proxy)
    assert span["endpoint"] == "completions" and span["response_token_ids"] == [100, 101, 102]
    assert span["prompt_token_ids"] == list(b"xyz") and span["completion_tokens"] == 3
    assert span["token_ids_injected"] is True  # return_token_ids was injected, logprobs was asked


def test_slow_stream_is_not_buffered(tmp_path, make_proxy):
    slow = StubServer(tmp_path, args=["--chunk-delay", "0.4"])
    try:
        p = make_proxy(upstreams=[slow.url])
        env = p.env_for("slow")
        body = {"model": "m", "messages": MSG, "max_tokens": 5, "stream": True}
        t0 = time.monotonic()
        stamps = []
        with httpx.Client(trust_env=False, timeout=60) as c:
            with c.stream("POST", env["OPENAI_BASE_URL"] + "/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        stamps.append(time.monotonic() - t0)
        assert len(stamps) == 7
        # 6 events 0.4 s apart: the first must arrive well before the last (no buffering)
        assert stamps[-1] - stamps[0] > 1.5
        (span,) = read_spans(p)
        assert span["response_token_ids"] == [100, 101, 102, 103, 104]
        assert span["ttft_ms"] < span["latency_ms"] - 1000
    finally:
        slow.stop()


@pytest.mark.parametrize("trust", ["upstream_ca", "ssl_insecure"])
def test_https_upstream_with_self_signed_cert(make_proxy, openai_from_env, stub_tls_server, trust):
    """Forward HTTPS to an HTTPS upstream whose self-signed cert the proxy is told to trust
    (--upstream-ca) or not to verify (--ssl-insecure)."""
    opts = {"upstream_ca": stub_tls_server.cert} if trust == "upstream_ca" else {"ssl_insecure": True}
    p = make_proxy(upstreams=[stub_tls_server.url], **opts)
    env = p.env_for("tls-up")
    env["OPENAI_BASE_URL"] = stub_tls_server.url + "/v1"  # the harness talks TLS to the upstream itself
    client = openai_from_env(env)
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=2, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in r if c.choices) == "w0 w1 "
    (span,) = read_spans(p)
    assert span["mode"] == "forward" and span["scheme"] == "https"
    assert span["upstream"].startswith("https://127.0.0.1:") and span["response_token_ids"] == [100, 101]


def test_https_upstream_untrusted_is_an_error_span(make_proxy, openai_from_env, stub_tls_server):
    p = make_proxy(upstreams=[stub_tls_server.url])  # neither upstream_ca nor ssl_insecure
    env = p.env_for("tls-bad")
    env["OPENAI_BASE_URL"] = stub_tls_server.url + "/v1"
    client = openai_from_env(env)
    import openai

    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="m", messages=MSG, max_tokens=2)
    (span,) = read_spans(p)
    assert span["error_kind"] == "upstream_unreachable" and "certificate" in span["error"].lower()


def test_other_traffic_passes_untouched_and_unrecorded(proxy, openai_from_env):
    client = openai_from_env(proxy.env_for("models"))
    assert [m.id for m in client.models.list()] == ["stub-model"]
    assert read_spans(proxy) == []


def test_pool_is_sticky_per_rollout(tmp_path, make_proxy, stub_server):
    other = StubServer(tmp_path)
    try:
        p = make_proxy(upstreams=[stub_server.url, other.url])
        with httpx.Client(trust_env=False, timeout=60) as c:
            for rid in ("a", "b", "c", "d"):
                for _ in range(3):
                    url = p.env_for(rid)["OPENAI_BASE_URL"] + "/chat/completions"
                    assert c.post(url, json={"model": "m", "messages": MSG, "max_tokens": 1}).status_code == 200
        spans = read_spans(p)
        by_rollout = {}
        for s in spans:
            by_rollout.setdefault(s["rollout_id"], set()).add(s["upstream"])
        assert all(len(v) == 1 for v in by_rollout.values()), by_rollout
        assert {u for v in by_rollout.values() for u in v} == {stub_server.url, other.url}
        assert [s["seq"] for s in spans if s["rollout_id"] == "a"] == [0, 1, 2]
    finally:
        other.stop()


def test_no_injection_when_disabled(make_proxy, openai_from_env, stub_server):
    p = make_proxy(inject_token_ids=False)
    client = openai_from_env(p.env_for("noinj"))
    client.chat.completions.create(model="m", messages=MSG, max_tokens=2)
    sent = stub_server.requests()[-1]
    assert "return_token_ids" not in sent and "logprobs" not in sent
    (span,) = read_spans(p)
    assert span["response_token_ids"] is None and span["token_ids_injected"] is False


def test_capture_only_reverse_target_without_pool(make_proxy, stub_server):
    """Capturing a deployed agent against some provider: no training pool, nothing injected."""
    p = make_proxy(upstreams=[], extra_args=["--reverse-target", stub_server.url + "/v1"])
    url = p.env_for("cap")["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c:
        r = c.post(url, json={"model": "m", "messages": MSG, "max_tokens": 2})
    assert r.status_code == 200 and "token_ids" not in r.text
    assert "return_token_ids" not in stub_server.requests()[-1]
    (span,) = read_spans(p)
    assert span["upstream"] == stub_server.url and span["token_ids_injected"] is False
    assert span["response_token_ids"] is None and span["error_kind"] is None


def test_no_upstream_configured_is_a_clear_502(make_proxy):
    p = make_proxy(upstreams=[])
    url = p.env_for("none")["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c:
        r = c.post(url, json={"model": "m", "messages": MSG})
    assert r.status_code == 502 and "no upstream configured" in r.text


def test_no_intercept_hosts_are_tunnelled_untouched(make_proxy, stub_tls_server):
    """--no-intercept: the client sees the upstream's own certificate, and nothing is recorded."""
    import ssl

    p = make_proxy(upstreams=[], extra_args=["--no-intercept", rf"^127\.0\.0\.1:{stub_tls_server.port}$"])
    env = p.env_for("tunnel")
    ctx = ssl.create_default_context(cafile=stub_tls_server.cert)  # trusts the stub only, not the proxy CA
    with httpx.Client(proxy=env["HTTPS_PROXY"], verify=ctx, trust_env=False, timeout=60) as c:
        r = c.post(stub_tls_server.url + "/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 1})
    assert r.status_code == 200
    assert read_spans(p) == []


@pytest.mark.parametrize("extra", [
    '"seed": 123456789012345678901234567890, "temperature": 1e-7',  # beyond 64 bits: the standard library's path
    '"top_p": NaN, "presence_penalty": -Infinity',  # orjson refuses these: the standard library's path
    '"temperature": 1e-7, "top_p": 0.1, "seed": -9223372036854775808, "user": "é \\u2028"',  # orjson's path
])
def test_harness_numbers_reach_upstream_exactly(proxy, stub_server, extra):
    """The proxy rewrites the request (token ids and logprobs injected); every value the harness
    sent must reach upstream as the same JSON value, whichever parser read it."""
    import urllib.request

    body = '{"model": "policy", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], ' + extra + "}"
    url = proxy.env_for("exact", 0)["OPENAI_BASE_URL"] + "/chat/completions"
    req = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as r:
        assert r.status == 200
    sent = stub_server.requests()[-1]
    assert sent["return_token_ids"] is True  # rewritten, so re-serialised
    want = json.loads(body)
    for key, value in want.items():
        assert json.dumps(sent[key]) == json.dumps(value), key  # json.dumps: NaN equals itself here


def test_no_injection_where_it_would_change_the_answer(proxy, stub_server):
    """Asked for token ids, vLLM blanks a completions call's echoed prompt (the harness read "111" for
    "1+1=111"); a chat call with top_logprobs but no logprobs, which vLLM refuses (400), succeeded once
    logprobs were injected. Both go upstream as the harness sent them; the trainer rebuilds their ids."""
    env = proxy.env_for("no-inject")
    with httpx.Client(trust_env=False, timeout=20) as c:
        auth = {"Authorization": f"Bearer {env['OPENAI_API_KEY']}"}
        c.post(env["OPENAI_BASE_URL"] + "/completions", headers=auth,
               json={"model": "m", "prompt": "1+1=", "echo": True, "max_tokens": 2})
        assert "return_token_ids" not in stub_server.requests()[-1]  # before the fix: injected
        c.post(env["OPENAI_BASE_URL"] + "/chat/completions", headers=auth,
               json={"model": "m", "messages": MSG, "top_logprobs": 2, "max_tokens": 2})
        sent = stub_server.requests()[-1]
        assert "logprobs" not in sent and "return_token_ids" not in sent
        c.post(env["OPENAI_BASE_URL"] + "/completions", headers=auth,
               json={"model": "m", "prompt": "1+1=", "max_tokens": 2})
        assert stub_server.requests()[-1]["return_token_ids"] is True  # the usual call still is
    spans = sorted(read_spans(proxy), key=lambda s: s["seq"])
    assert [s["token_ids_injected"] for s in spans] == [False, False, True]
