"""Upstreams that compress model responses although asked for identity (gateways, CDNs): the span
holds decoded JSON and token ids, and the harness gets a body it can decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures_compat import client_env, python_client, run_client
from fixtures_proxy import StubServer, read_spans

pytestmark = pytest.mark.timeout(300)

PROXY_PY = Path(__file__).resolve().parents[1] / ".venv-proxy" / "bin" / "python"


@pytest.fixture(params=["gzip", "br"])
def compressing_stub(request, tmp_path):
    """A stub that compresses every model response with gzip or br (br: run with the proxy env's
    Python, which has `brotli`)."""
    python = None
    if request.param == "br":
        from lightning_harness.proxy.locate import proxy_python

        python = proxy_python()
    srv = StubServer(tmp_path, python=python)
    srv.configure(encoding=request.param)
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_compressed_upstream(make_proxy, compressing_stub, stream):
    p = make_proxy(upstreams=[compressing_stub.url])
    env = client_env(p.env_for("enc"))
    args = ["requests", env["OPENAI_BASE_URL"] + "/chat/completions", "policy",
            "--gzip"] + (["--stream"] if stream else [])
    out = run_client(python_client("http_client.py", *args), env)
    assert out["status"] == 200
    # the client asked for gzip only: it never gets brotli (requests here cannot decode br)
    assert out["content_encoding"] in (None, "gzip")
    if stream:
        assert out["done"]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in out["events"] if e["choices"])
        assert text == "w0 w1 w2 "
        assert not any('token_ids": [' in json.dumps(e) for e in out["events"])  # (null, as plain vLLM says)
    else:
        assert out["body"]["choices"][0]["message"]["content"] == "w0 w1 w2 "
        assert out["body"]["prompt_token_ids"] is None and out["body"]["choices"][0]["logprobs"] is None
    assert compressing_stub.requests()[-1]["return_token_ids"] is True
    (span,) = read_spans(p)
    assert span["error_kind"] is None, span["error"]
    assert span["response_token_ids"] == [100, 101, 102] and span["prompt_token_ids"] == list(b"hi")
    assert json.loads(span["response_json"])["choices"][0]["token_ids"] == [100, 101, 102]


def test_compressed_upstream_openai_client(make_proxy, tmp_path, openai_from_env):
    """The official client (accepts gzip, deflate) against a gzip upstream, JSON and stream."""
    srv = StubServer(tmp_path)
    try:
        srv.configure(encoding="gzip")
        p = make_proxy(upstreams=[srv.url])
        client = openai_from_env(p.env_for("enc-oai"))
        r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert r.choices[0].message.content == "w0 w1 "
        chunks = list(client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=2, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "w0 w1 "
        s1, s2 = read_spans(p)
        assert s1["response_token_ids"] == s2["response_token_ids"] == [100, 101]
        assert s1["error_kind"] is None and s2["error_kind"] is None
    finally:
        srv.stop()


# -- pure parts (no mitmproxy) ------------------------------------------------------------------
def test_accepted_codings():
    from lightning_harness.proxy.codec import accepted

    assert accepted("gzip, deflate") == {"gzip", "deflate"}
    assert accepted("br;q=0, gzip;q=0.5, *;q=0") == {"gzip"}
    assert accepted(None) == set() and accepted("") == set()
    assert accepted("GZIP ; q=1.0, identity") == {"gzip", "identity"}


@pytest.mark.parametrize("coding", ["gzip", "deflate", "deflate-raw"])
def test_stream_decoder_byte_by_byte(coding):
    import zlib

    from lightning_harness.proxy.codec import StreamDecoder

    data = b"".join(b'data: {"i": %d}\n\n' % i for i in range(50)) + b"data: [DONE]\n\n"
    wbits = {"gzip": 31, "deflate": 15, "deflate-raw": -15}[coding]
    c = zlib.compressobj(wbits=wbits)
    blob = c.compress(data) + c.flush()
    dec = StreamDecoder.make(coding.split("-")[0])
    out = b"".join(dec.feed(blob[i : i + 1]) for i in range(len(blob))) + dec.end()
    assert out == data
    assert StreamDecoder.make("compress") is None


def test_join_chunks_never_returns_empty_bytes():
    from lightning_harness.proxy.codec import join_chunks

    assert join_chunks([], b"") == [] and join_chunks(b"a", [b"b", b""], []) == b"ab"
