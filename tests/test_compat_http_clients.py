"""curl, `requests` and plain `httpx` with their defaults, configured only by the printed environment:
forward proxy with TLS interception (CA from CURL_CA_BUNDLE / REQUESTS_CA_BUNDLE / SSL_CERT_FILE),
an HTTPS training upstream, and the reverse URL reached through the forward proxy."""

from __future__ import annotations

import json
import subprocess

import pytest
from fixtures_compat import client_env, python_client, run_client
from fixtures_proxy import read_spans

pytestmark = pytest.mark.timeout(300)

BODY = {"model": "policy", "messages": [{"role": "user", "content": "curl"}], "max_tokens": 3}


def curl(env: dict, url: str, body: dict, *flags: str, tmp_path) -> tuple[str, str, str]:
    """(http_code, http_version, body) of one curl call with exactly ``env``."""
    out, data = tmp_path / "curl-body", tmp_path / "curl-data.json"
    data.write_text(json.dumps(body))
    r = subprocess.run(
        ["curl", "-sS", "-o", str(out), "-w", "%{http_code} %{http_version}", "-H", "Content-Type: application/json",
         "-H", "Authorization: Bearer sk-curl-secret", "--data-binary", f"@{data}", *flags, url],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, f"curl exit {r.returncode}: {r.stderr}"
    code, version = r.stdout.split()
    return code, version, out.read_text()


@pytest.fixture
def tls_proxy(make_proxy, stub_tls_server):
    """A proxy whose training upstream is HTTPS (self-signed, trusted with --upstream-ca)."""
    return make_proxy(upstreams=[stub_tls_server.url], upstream_ca=stub_tls_server.cert)


@pytest.mark.skipif(subprocess.run(["which", "curl"], capture_output=True).returncode, reason="curl not installed")
def test_curl_lowercase_proxy_https_upstream_and_reverse(tls_proxy, stub_tls_server, tmp_path):
    env = tls_proxy.env_for("curl-1")
    # curl reads only the lowercase http_proxy (and https_proxy or HTTPS_PROXY): give it just those
    cenv = client_env({k: env[k] for k in ("http_proxy", "https_proxy", "CURL_CA_BUNDLE", "no_proxy")})
    # 0. without CURL_CA_BUNDLE the interception certificate is not trusted (the variable matters)
    bare = {k: v for k, v in cenv.items() if k != "CURL_CA_BUNDLE"}
    r = subprocess.run(["curl", "-sS", "-o", "/dev/null", stub_tls_server.url + "/health"], env=bare,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 60, (r.returncode, r.stderr)  # 60: peer certificate cannot be authenticated
    # 1. the HTTPS training upstream itself, intercepted (certificate from our CA via CURL_CA_BUNDLE)
    code, version, text = curl(cenv, stub_tls_server.url + "/v1/chat/completions", BODY, tmp_path=tmp_path)
    assert code == "200", text
    assert json.loads(text)["choices"][0]["message"]["content"] == "w0 w1 w2 "
    # 2. a route host over HTTPS, HTTP/2 negotiated by curl's default ALPN (curl built with nghttp2)
    code, version2, text = curl(cenv, "https://api.openai.com/v1/chat/completions", {**BODY, "stream": True},
                                "-N", tmp_path=tmp_path)
    assert code == "200" and "data: [DONE]" in text and "token_ids" not in text
    # 3. the reverse URL, reached through http_proxy (NO_PROXY is empty)
    code, _, text = curl(cenv, env["OPENAI_BASE_URL"] + "/chat/completions", BODY, tmp_path=tmp_path)
    assert code == "200" and json.loads(text)["model"] == "policy"
    spans = read_spans(tls_proxy)
    assert [(s["mode"], s["scheme"], s["stream"]) for s in spans] == [
        ("forward", "https", False), ("forward", "https", True), ("reverse", "http", False)]
    assert all(s["response_token_ids"] == ([100, 101, 102]) and s["error_kind"] is None for s in spans)
    assert spans[1]["host"] == "api.openai.com" and version2 in ("2", "1.1")
    assert not any("sk-curl-secret" in (s["request_json"] or "") for s in spans)


@pytest.mark.skipif(subprocess.run(["which", "curl"], capture_output=True).returncode, reason="curl not installed")
def test_curl_http2_through_forward_proxy(proxy, tmp_path):
    """HTTP/2 client over TLS through the forward proxy (curl --http2: ALPN h2 inside the tunnel)."""
    cenv = client_env(proxy.env_for("curl-h2"))
    code, version, text = curl(cenv, "https://api.openai.com/v1/chat/completions", {**BODY, "stream": True},
                               "--http2", "-N", tmp_path=tmp_path)
    assert (code, version) == ("200", "2"), text
    events = [json.loads(ln[5:]) for ln in text.splitlines() if ln.startswith("data:") and "[DONE]" not in ln]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == "w0 w1 w2 "
    code, version, text = curl(cenv, "https://api.openai.com/v1/chat/completions", BODY, "--http2", tmp_path=tmp_path)
    assert (code, version) == ("200", "2") and json.loads(text)["choices"][0]["finish_reason"] == "length"
    s1, s2 = read_spans(proxy)
    assert s1["stream"] and s1["response_token_ids"] == [100, 101, 102] and s1["error_kind"] is None
    assert s2["response_token_ids"] == [100, 101, 102] and s2["error_kind"] is None


@pytest.mark.parametrize("lib", ["requests", "httpx", "urllib"])
def test_python_http_libraries_forward_tls(lib, tls_proxy):
    """requests trusts REQUESTS_CA_BUNDLE, httpx and urllib SSL_CERT_FILE; all use HTTPS_PROXY by default."""
    env = tls_proxy.env_for(f"{lib}-1")
    keep = {"requests": "REQUESTS_CA_BUNDLE", "httpx": "SSL_CERT_FILE", "urllib": "SSL_CERT_FILE"}[lib]
    cas = {"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"}
    cenv = client_env({k: v for k, v in env.items() if k not in cas - {keep}})  # only the library's own variable
    out = run_client(python_client("http_client.py", lib, "https://api.openai.com/v1/chat/completions", "policy"), cenv)
    assert out["status"] == 200 and out["body"]["choices"][0]["message"]["content"] == "w0 w1 w2 "
    assert "prompt_token_ids" not in out["body"]
    out = run_client(python_client("http_client.py", lib, "https://api.openai.com/v1/chat/completions", "policy",
                                   "--stream"), cenv)
    assert out["done"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in out["events"] if e["choices"])
    assert text == "w0 w1 w2 "
    assert not any("token_ids" in json.dumps(e) for e in out["events"])
    s1, s2 = read_spans(tls_proxy)
    assert (s1["rollout_id"], s1["scheme"], s1["host"]) == (f"{lib}-1", "https", "api.openai.com")
    assert s1["response_token_ids"] == s2["response_token_ids"] == [100, 101, 102]


def test_aiohttp_default_session_reverse_url(proxy):
    """aiohttp ignores HTTP(S)_PROXY unless trust_env=True: such a harness is captured through the
    base URL (reverse mode), JSON and SSE."""
    pytest.importorskip("aiohttp")
    env = client_env(proxy.env_for("aiohttp-1"))
    url = env["OPENAI_BASE_URL"] + "/chat/completions"
    out = run_client(python_client("http_client.py", "aiohttp", url, "policy"), env)
    assert out["status"] == 200 and out["body"]["choices"][0]["message"]["content"] == "w0 w1 w2 "
    out = run_client(python_client("http_client.py", "aiohttp", url, "policy", "--stream"), env)
    # nothing injected leaks (the pool's chunks say "token_ids": null, as plain vLLM's do)
    assert out["done"] and not any('token_ids": [' in json.dumps(e) for e in out["events"])
    spans = read_spans(proxy)
    assert [s["mode"] for s in spans] == ["reverse", "reverse"]
    assert all(s["response_token_ids"] == [100, 101, 102] for s in spans)


def test_httpx_http2_forward_tls(proxy):
    """httpx with http2=True (the `h2` package) over TLS through the forward proxy is captured.

    mitmproxy mirrors the upstream's ALPN to the client: the stub speaks HTTP/1.1, so the client is
    offered HTTP/1.1 (an h2 upstream gives an h2 client session); either way the call must work."""
    pytest.importorskip("h2", reason="the `h2` package is not installed in this environment: httpx cannot speak HTTP/2")
    out = run_client(python_client("httpx_h2_client.py", "https://api.openai.com/v1/chat/completions"),
                     client_env(proxy.env_for("h2-1")))
    assert out["http_version"] in ("HTTP/2", "HTTP/1.1") and out["content"] == "w0 w1 w2 "
    (span,) = read_spans(proxy)
    assert span["response_token_ids"] == [100, 101, 102]


@pytest.mark.skipif(subprocess.run(["which", "curl"], capture_output=True).returncode, reason="curl not installed")
@pytest.mark.parametrize("proto", ["--http1.1", "--http2"])
def test_curl_large_prompt(proxy, tmp_path, proto):
    """A 300 KB prompt (long agent transcripts) intercepted over TLS and through the reverse URL."""
    env = client_env(proxy.env_for("big"))
    body = {"model": "policy", "messages": [{"role": "user", "content": "x" * 300_000}], "max_tokens": 2}
    for url in ("https://api.openai.com/v1/chat/completions", env["OPENAI_BASE_URL"] + "/chat/completions"):
        code, _, text = curl(env, url, body, proto, tmp_path=tmp_path)
        assert code == "200" and json.loads(text)["choices"][0]["message"]["content"] == "w0 w1 "
    spans = read_spans(proxy)
    assert [s["mode"] for s in spans] == ["forward", "reverse"]
    assert all(s["response_token_ids"] == [100, 101] and len(s["request_json"]) > 300_000 for s in spans)
