"""The official `openai` npm package (Node), unmodified, configured only by the printed environment.

Node's fetch ignores HTTP(S)_PROXY, so Node harnesses are captured through OPENAI_BASE_URL
(reverse mode); the package reads it by default.
"""

from __future__ import annotations

import pytest
from fixtures_compat import client_env, run_client
from fixtures_proxy import read_spans

pytestmark = pytest.mark.timeout(600)


def test_node_openai_json_reverse_mode_maps_model_back(make_proxy, node_app, stub_server):
    p = make_proxy(served_model="policy-v")
    env = client_env(p.env_for("node-json", 1))
    out = run_client(node_app("openai_node.mjs", "gpt-4o", "json"), env)
    assert out["baseURL"] == env["OPENAI_BASE_URL"]
    assert out["content"] == "w0 w1 w2 " and out["finish_reason"] == "length"
    assert out["model"] == "gpt-4o"  # asked for gpt-4o, served by policy-v: mapped back
    # not asked for: null, as plain vLLM says (JSON.stringify leaves an undefined member out of the list as null)
    assert out["logprobs"] is None and out["token_ids"] == [None, None] and "token_ids" in out["keys"]
    assert stub_server.requests()[-1]["model"] == "policy-v"
    (span,) = read_spans(p)
    assert (span["rollout_id"], span["attempt"], span["mode"]) == ("node-json", 1, "reverse")
    assert (span["model"], span["served_model"]) == ("gpt-4o", "policy-v")
    assert span["response_token_ids"] == [100, 101, 102] and span["prompt_token_ids"] == list(b"hello from node")
    assert '"policy-v"' in span["response_json"]  # the span keeps what upstream answered


def test_node_openai_stream_with_usage(make_proxy, node_app):
    p = make_proxy(served_model="policy-v")
    out = run_client(node_app("openai_node.mjs", "gpt-4o", "stream"), client_env(p.env_for("node-sse")))
    assert out["content"] == "w0 w1 w2 w3 " and out["finish_reason"] == "length"
    assert set(out["models"]) == {"gpt-4o"} and out["extra"] == []
    assert out["usage"]["completion_tokens"] == 4
    (span,) = read_spans(p)
    assert span["stream"] is True and span["mode"] == "reverse" and span["error_kind"] is None
    assert span["response_token_ids"] == [100, 101, 102, 103]
    assert span["response_logprobs"] == pytest.approx([-0.01, -0.02, -0.03, -0.04])
    assert span["completion_tokens"] == 4


def test_node_openai_tls_upstream_and_extra_ca(make_proxy, node_app, stub_tls_server):
    """Reverse mode in front of an HTTPS training upstream; NODE_EXTRA_CA_CERTS (our bundle) loads
    cleanly (Node warns and ignores a bundle it cannot read)."""
    import subprocess

    p = make_proxy(upstreams=[stub_tls_server.url], upstream_ca=stub_tls_server.cert)
    env = client_env(p.env_for("node-tls"))
    cmd = node_app("openai_node.mjs", "policy", "json")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "Ignoring extra certs" not in r.stderr and "NODE_EXTRA_CA_CERTS" not in r.stderr, r.stderr
    (span,) = read_spans(p)
    assert span["upstream"] == stub_tls_server.url and span["response_token_ids"] == [100, 101, 102]


@pytest.mark.parametrize("coding", ["gzip", "br"])
def test_node_openai_compressing_upstream(make_proxy, node_app, tmp_path, coding):
    """Node's fetch accepts gzip/deflate/br; a compressing upstream still yields a valid body and stream."""
    from fixtures_proxy import StubServer

    from lightning_harness.proxy.locate import proxy_python

    srv = StubServer(tmp_path, python=proxy_python() if coding == "br" else None)  # br: needs `brotli`
    try:
        srv.configure(encoding=coding)
        p = make_proxy(upstreams=[srv.url])
        env = client_env(p.env_for(f"node-{coding}"))
        out = run_client(node_app("openai_node.mjs", "policy", "json"), env)
        assert out["content"] == "w0 w1 w2 " and out["logprobs"] is None
        out = run_client(node_app("openai_node.mjs", "policy", "stream"), env)
        assert out["content"] == "w0 w1 w2 w3 " and out["extra"] == []
        s1, s2 = read_spans(p)
        assert s1["response_token_ids"] == [100, 101, 102] and s2["response_token_ids"] == [100, 101, 102, 103]
        assert s1["error_kind"] is None and s2["error_kind"] is None
    finally:
        srv.stop()
