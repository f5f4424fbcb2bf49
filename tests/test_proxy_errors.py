"""Upstream errors, timeouts, disconnects and malformed JSON become error spans; serving goes on."""

from __future__ import annotations

import json
import queue
import ssl
import time

import httpx
import openai
import pytest
from conftest import free_port
from fixtures_proxy import ScriptedUpstream, StubServer, read_spans
from test_hostile_responses import ANSWER_IDS, START, _event, _late_response, _response

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
    """The span's status is the one the harness got (it was null): a stream's head went out with
    upstream's 200 before the drop; of a buffered answer nothing had, and mitmproxy answers 502."""
    url = proxy.env_for("drop")["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c:
        with pytest.raises(httpx.HTTPError):
            with c.stream("POST", url, json={**BODY, "stream": True}, headers={"X-Stub-Drop": "1"}) as r:
                assert r.status_code == 200
                for _ in r.iter_raw():
                    pass
        buffered = c.post(proxy.env_for("drop-json")["OPENAI_BASE_URL"] + "/chat/completions", json=BODY,
                          headers={"X-Stub-Drop": "1"})
    assert buffered.status_code == 502
    spans = {s["rollout_id"]: s for s in _poll_spans(proxy, 2)}
    for rollout, status in (("drop", 200), ("drop-json", 502)):
        span = spans[rollout]
        assert span["error_kind"] == "upstream_unreachable" and "mid-response" in span["error"]
        assert span["status_code"] == status, rollout
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


@pytest.mark.parametrize("path", ["/chat/completions", "/messages"])
def test_client_disconnect_mid_stream(tmp_path, make_proxy, path):
    """The harness got the head of the answer (upstream's 200, relayed; a Messages stream too) and
    some events before it left: the span's status is that 200 (it was null, which says no status
    was returned)."""
    slow = StubServer(tmp_path, args=["--chunk-delay", "0.5"])
    try:
        p = make_proxy(upstreams=[slow.url])
        url = p.env_for("gone")["OPENAI_BASE_URL"] + path
        with httpx.Client(trust_env=False, timeout=60) as c:
            with c.stream("POST", url, json={**BODY, "max_tokens": 20, "stream": True}) as r:
                for line in r.iter_lines():
                    if "w0" in line:
                        break  # the harness gives up after the first token
        spans = _poll_spans(p, 1)
        (span,) = spans
        assert span["error_kind"] == "client_disconnect" and span["status_code"] == r.status_code == 200
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


def _stream_until(p, rollout: str, stop_at: str | None = None) -> int:
    """Stream a chat call until the proxy ends it (or stop the proxy once ``stop_at`` is in);
    returns the status the harness got."""
    url = p.env_for(rollout)["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c, c.stream("POST", url, json={**BODY, "stream": True}) as r:
        try:
            for line in r.iter_lines():
                if stop_at is not None and stop_at in line:
                    assert p.stop() == 0  # the proxy stops with the stream in flight
        except httpx.HTTPError:
            pass  # the proxy closed the stream
    return r.status_code


def test_a_stream_cut_short_after_its_head_keeps_the_status_the_harness_got(tmp_path, make_proxy):
    """A stream that stalls after upstream's 200 went out (the idle timeout closes it), and one still
    running when the proxy stops: their spans said status null (none returned), while the harness
    had the 200 and some events."""
    from lightning_harness.schemas import read_table

    slow = StubServer(tmp_path, args=["--chunk-delay", "0.5"])
    try:
        p = make_proxy(upstreams=[slow.url], extra_args=["--idle-timeout", "2", "--shutdown-grace", "1"])
        slow.post("/_stub/config", {"chunk_delay": 4})  # longer than the idle timeout
        assert _stream_until(p, "stalled") == 200
        slow.post("/_stub/config", {})
        assert _stream_until(p, "stopped", stop_at="w0") == 200
        rows = {r["rollout_id"]: r for r in read_table(p.traces_dir, "spans").to_pylist()}
        assert [(rows[r]["error_kind"], rows[r]["status_code"]) for r in ("stalled", "stopped")] == [
            ("timeout", 200), ("shutdown", 200)], [rows[r]["error"] for r in rows]
    finally:
        slow.stop()


# -- an upstream that goes on after its final event ----------------------------------------------------
TAIL_S = 20  # how long it goes on when nobody stops it


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class TailUpstream(ScriptedUpstream):
    """A hostile upstream: sends ``events`` (up to its final event), then the ``tail`` events over
    and over (each one HTTP chunk, right behind the final event) for up to TAIL_S. ``cut`` gets
    how long it went on before the proxy closed the connection (None: it never did)."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.tail: list[bytes] = []
        self.cut: queue.Queue = queue.Queue()
        super().__init__()

    def _answer(self, conn) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in self.events:
            conn.sendall(_chunk(event))
        start = time.monotonic()
        try:
            while time.monotonic() - start < TAIL_S:
                for event in self.tail:
                    conn.sendall(_chunk(event))
                time.sleep(0.02)
            conn.sendall(b"0\r\n\r\n")
        except OSError:
            self.cut.put(time.monotonic() - start)
        else:
            self.cut.put(None)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chat(delta: dict, ids: list[int], finish: str | None = None, **extra) -> bytes:
    """A vLLM chat chunk with its token ids."""
    return _sse({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": ids}],
                 **extra})


CHAT_ANSWER = [_chat({"role": "assistant", "content": ""}, [], prompt_token_ids=[1, 2, 3]),
               _chat({"content": "w0 "}, [100]),
               _chat({"content": "w1"}, [101], "stop", usage={"prompt_tokens": 3, "completion_tokens": 2})]
CHAT_TAIL = [_chat({"content": " LATE"}, [999]),  # more content, another final event (other usage), [DONE]
             _chat({"content": " AGAIN"}, [998], "length", usage={"prompt_tokens": 7, "completion_tokens": 9}),
             b"data: [DONE]\n\n"]


RESPONSES_ANSWER = [*START, _event({"type": "response.completed", "response": _response()})]
RESPONSES_TAIL = [_event({"type": "response.output_text.delta", "delta": " LATE", "output_index": 0,
                          "content_index": 0}),
                  _event({"type": "response.completed", "response": _late_response()}), b"data: [DONE]\n\n"]


class H2First(ssl.SSLContext):
    """ALPN with h2 offered first, as Codex (Rust) offers it: mitmproxy takes the client's first choice."""

    def set_alpn_protocols(self, protocols):
        super().set_alpn_protocols(sorted(protocols, key=lambda p: p != "h2"))


def _read_until_final(env: dict, path: str, body: dict, final: str, http2: bool) -> tuple[str, list[str]]:
    """Stream a call and close it (HTTP/1.1) or reset its stream (HTTP/2) once the data line holding
    ``final`` is in, as Codex does; returns the HTTP version and the data lines read."""
    if http2:
        ctx = H2First(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cafile=env["SSL_CERT_FILE"])
        client = httpx.Client(http2=True, verify=ctx, proxy=env["HTTPS_PROXY"], trust_env=False, timeout=60)
        url = "https://api.openai.com/v1" + path
    else:
        client, url = httpx.Client(trust_env=False, timeout=60), env["OPENAI_BASE_URL"] + path
    lines = []
    with client, client.stream("POST", url, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                lines.append(line)
                if final in line.replace(" ", ""):
                    break
    return r.http_version, lines


def _answer_of(span: dict, api: str) -> tuple:
    """What a span recorded of the answer: (error, status, token ids, finish reason, usage, text)."""
    obj = json.loads(span["response_json"])
    text = obj["output"][0]["content"][0]["text"] if api == "responses" else obj["choices"][0]["message"]["content"]
    return (span["error_kind"], span["status_code"], span["response_token_ids"], span["finish_reason"],
            span["prompt_tokens"], span["completion_tokens"], text)


FIRST_ANSWER = {"chat": (None, 200, [100, 101], "stop", 3, 2, "w0 w1"),
                "responses": (None, 200, ANSWER_IDS, "stop", 6, 3, "hi there")}
FIRST_ANSWER["messages"] = FIRST_ANSWER["chat"]  # (the span holds the chat answer upstream sent)


def _messages_answer(lines: list[str]) -> tuple[str, str, int]:
    """(text, stop reason, output tokens) of the Messages events a client read."""
    events = [json.loads(line[len("data:"):]) for line in lines]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    return text, delta["delta"]["stop_reason"], delta["usage"]["output_tokens"]


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_client_gone_after_the_final_event_gets_the_first_answer_recorded_once(make_proxy, api, http2):
    """A hostile upstream sends its final event and goes on streaming right behind it (more content,
    another final event with other token ids and usage, [DONE]), and the harness leaves once it has
    the final event (Codex resets its HTTP/2 stream). The span held the answer mixed with what came
    after (chat: "w0 w1 LATE AGAIN", finish_reason length, the second usage; Responses: the second
    answer's text and token ids): now the first answer only. A Messages client (its call sent
    upstream as chat) got the late content too ("w0 w1 LATE AGAIN", max_tokens, 9 tokens, its
    message_stop only at [DONE]); now its stream ends with the final chunk, as the span's answer
    does. The proxy closes the upstream connection (no stream left running, no hang) and records
    the call once."""
    up = TailUpstream()
    try:
        p = make_proxy(upstreams=[up.url])
        if api == "chat":
            up.events, up.tail = CHAT_ANSWER, CHAT_TAIL
            path, body, final = "/chat/completions", {**BODY, "stream": True}, '"finish_reason":"stop"'
        elif api == "messages":  # (OPENAI_BASE_URL + /messages is ANTHROPIC_BASE_URL + /v1/messages)
            up.events, up.tail = CHAT_ANSWER, CHAT_TAIL
            path, body, final = "/messages", {**BODY, "stream": True}, "message_stop"
        else:
            up.events, up.tail = RESPONSES_ANSWER, RESPONSES_TAIL
            path, body, final = "/responses", {"model": "m", "input": "hello", "stream": True}, "response.completed"
        version, lines = _read_until_final(p.env_for(api), path, body, final, http2)
        assert version == ("HTTP/2" if http2 else "HTTP/1.1") and "LATE" not in "".join(lines)
        (span,) = _poll_spans(p, 1)
        assert _answer_of(span, api) == FIRST_ANSWER[api] and span["error"] is None, span["error"]
        if api == "responses":
            assert json.loads(span["response_json"]) == _response()
        if api == "messages":
            assert _messages_answer(lines) == ("w0 w1", "end_turn", 2)
        cut = up.cut.get(timeout=TAIL_S + 30)
        assert cut is not None and cut < 10, f"the upstream kept streaming {cut} s after the client left"
        time.sleep(1)
        assert len(read_spans(p)) == 1 and p.control.state()["in_flight"] == 0
    finally:
        up.close()


def test_chat_content_after_the_final_chunk_is_relayed_but_not_recorded(make_proxy):
    """A client that reads on past the final chunk gets what the upstream sent after it, as sent;
    the span keeps the answer the final chunk ended (it had the late content, token ids, finish
    reason and usage mixed in). Content after a ``[DONE]`` that came without a finish reason is
    no part of the answer either (the openai clients stop reading at ``[DONE]``)."""
    up = ScriptedUpstream()
    try:
        p = make_proxy(upstreams=[up.url])
        url = p.env_for("stays")["OPENAI_BASE_URL"] + "/chat/completions"
        up.sse([*CHAT_ANSWER, *CHAT_TAIL])
        with httpx.Client(trust_env=False, timeout=60) as c:
            r = c.post(url, json={**BODY, "stream": True})
        assert r.text.count("finish_reason") == 5 and " LATE" in r.text and " AGAIN" in r.text
        (span,) = read_spans(p)
        assert _answer_of(span, "chat") == FIRST_ANSWER["chat"], span["error"]
        up.sse([*CHAT_ANSWER[:2], b"data: [DONE]\n\n", *CHAT_TAIL])
        with httpx.Client(trust_env=False, timeout=60) as c:
            r = c.post(p.env_for("done")["OPENAI_BASE_URL"] + "/chat/completions", json={**BODY, "stream": True})
        assert " LATE" in r.text
        (span,) = [s for s in read_spans(p) if s["rollout_id"] == "done"]
        assert _answer_of(span, "chat") == (None, 200, [100], None, 3, 1, "w0 "), span["error"]
    finally:
        up.close()
