"""Upstream errors, timeouts, disconnects and malformed JSON become error spans; serving goes on."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import free_port
from fixtures_proxy import StubServer, read_spans

pytestmark = pytest.mark.timeout(300)

MSG = [{"role": "user", "content": "hi"}]
BODY = {"model": "m", "messages": MSG, "max_tokens": 3}


def _still_serves(p) -> None:
    url = p.env_for("after")["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c:
        assert c.post(url, json=BODY).status_code == 200


def test_upstream_status_error(proxy, openai_from_env):
    client = openai_from_env(proxy.env_for("e500"))
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="m", messages=MSG, extra_headers={"X-Stub-Fail": "500"})
    (span,) = read_spans(proxy)
    assert span["error_kind"] == "upstream_status" and span["status_code"] == 500
    assert "HTTP 500" in span["error"] and "stub failure 500" in span["error"]
    _still_serves(proxy)


def test_upstream_unreachable(make_proxy, openai_from_env):
    p = make_proxy(upstreams=[f"http://127.0.0.1:{free_port()}"])
    client = openai_from_env(p.env_for("down"))
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model="m", messages=MSG)
    assert exc.value.status_code == 502
    (span,) = read_spans(p)
    assert span["error_kind"] == "upstream_unreachable" and span["status_code"] == 502
    assert "before answering" in span["error"]
    assert p.control.state()["in_flight"] == 0


def test_malformed_request_body_is_forwarded_and_recorded(proxy):
    url = proxy.env_for("bad-req")["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c:
        r = c.post(url, content=b'{"model": "m", "messages": [', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.text  # the upstream's own answer
    (span,) = read_spans(proxy)
    assert span["error_kind"] == "malformed_request" and "not valid JSON" in span["error"]
    assert span["request_json"] == '{"model": "m", "messages": ['
    _still_serves(proxy)


def test_malformed_response_json(proxy):
    url = proxy.env_for("bad-resp")["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c:
        r = c.post(url, json=BODY, headers={"X-Stub-Malformed": "1"})
    assert r.status_code == 200 and r.text == '{"id": "broken", "choices": [}'  # passed through untouched
    (span,) = read_spans(proxy)
    assert span["error_kind"] == "malformed_response" and "not valid JSON" in span["error"]


def test_malformed_sse_event(proxy):
    url = proxy.env_for("bad-sse")["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c:
        r = c.post(url, json={**BODY, "stream": True}, headers={"X-Stub-Malformed": "1"})
    assert r.status_code == 200 and "{not json" in r.text and r.text.rstrip().endswith("[DONE]")
    (span,) = read_spans(proxy)
    assert span["error_kind"] == "malformed_response" and "malformed SSE event" in span["error"]
    assert span["response_token_ids"] == [101, 102]  # the first token event was the broken one


def test_upstream_drops_mid_stream(proxy):
    url = proxy.env_for("drop")["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c:
        with pytest.raises(httpx.HTTPError):
            with c.stream("POST", url, json={**BODY, "stream": True}, headers={"X-Stub-Drop": "1"}) as r:
                for _ in r.iter_raw():
                    pass
    spans = _poll_spans(proxy, 1)
    (span,) = spans
    assert span["error_kind"] == "upstream_unreachable" and "mid-response" in span["error"]
    _still_serves(proxy)


def _poll_spans(p, n, timeout=30):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = read_spans(p)
        if len(spans) >= n:
            return spans
        time.sleep(0.1)
    return read_spans(p)


def test_client_disconnect_mid_stream(tmp_path, make_proxy):
    slow = StubServer(tmp_path, args=["--chunk-delay", "0.5"])
    try:
        p = make_proxy(upstreams=[slow.url])
        url = p.env_for("gone")["OPENAI_BASE_URL"] + "/chat/completions"
        with httpx.Client(trust_env=False, timeout=60) as c:
            with c.stream("POST", url, json={**BODY, "max_tokens": 20, "stream": True}) as r:
                for line in r.iter_lines():
                    if "w0" in line:
                        break  # the harness gives up after the first token
        spans = _poll_spans(p, 1)
        (span,) = spans
        assert span["error_kind"] == "client_disconnect" and span["status_code"] is None
        assert span["response_token_ids"][:1] == [100]  # what had arrived is kept
        assert p.control.state()["in_flight"] == 0
        _still_serves(p)
    finally:
        slow.stop()


def test_a_stream_closed_by_the_client_after_its_final_event_is_not_an_error(tmp_path, make_proxy):
    """A harness may stop reading once the final event is in and close the connection (HTTP/1.1) or
    reset the stream (HTTP/2: Codex does so after ``response.completed``) before upstream ends it:
    it had the whole answer, so the span is a call like any other (it was an error span, lost to
    training). A close before the final event stays a client disconnect (the test above)."""
    from fixtures_compat import client_env, python_client, run_client

    slow = StubServer(tmp_path, args=["--chunk-delay", "0.3"])  # the close lands before [DONE]
    try:
        p = make_proxy(upstreams=[slow.url])
        url = p.env_for("h1")["OPENAI_BASE_URL"] + "/chat/completions"
        with httpx.Client(trust_env=False, timeout=60) as c:
            with c.stream("POST", url, json={**BODY, "stream": True}) as r:
                for line in r.iter_lines():
                    if '"finish_reason":"length"' in line.replace(" ", ""):
                        break
        out = run_client(python_client("httpx_h2_client.py", "https://api.openai.com/v1/chat/completions",
                                       "--stop-at-finish"), client_env(p.env_for("h2")))
        assert (out["http_version"], out["content"]) == ("HTTP/2", "w0 w1 w2 ")
        out = run_client(python_client("httpx_h2_client.py", "https://api.openai.com/v1/chat/completions",
                                       "--stop-at-first"), client_env(p.env_for("h2-gone")))
        assert (out["http_version"], out["content"]) == ("HTTP/2", "w0 ")
        spans = {s["rollout_id"]: s for s in _poll_spans(p, 3)}
        assert set(spans) == {"h1", "h2", "h2-gone"}
        gone = spans.pop("h2-gone")  # reset before the final event: the client's doing, not upstream's
        assert gone["error_kind"] == "client_disconnect", gone["error"]
        for span in spans.values():
            assert (span["error_kind"], span["error"], span["status_code"]) == (None, None, 200), span["error"]
            assert span["response_token_ids"] == [100, 101, 102] and span["finish_reason"] == "length"
        assert p.control.state()["in_flight"] == 0
    finally:
        slow.stop()


def test_hung_upstream_times_out(tmp_path, make_proxy):
    slow = StubServer(tmp_path, args=["--delay", "30"])
    try:
        p = make_proxy(upstreams=[slow.url], extra_args=["--idle-timeout", "2"])
        url = p.env_for("hung")["OPENAI_BASE_URL"] + "/chat/completions"
        with httpx.Client(trust_env=False, timeout=60) as c:
            try:
                r = c.post(url, json=BODY)
                assert r.status_code >= 500
            except httpx.HTTPError:
                pass  # mitmproxy may close the connection instead of answering
        (span,) = _poll_spans(p, 1)
        assert span["error_kind"] == "timeout", span["error"]
        assert p.control.state()["in_flight"] == 0
    finally:
        slow.stop()
