"""Hostile input on the capture side (issue 10): nothing is lost, nothing grows without bound.

Real proxy process, real stub upstream, real httpx and raw sockets, real Parquet: bytes that are not
UTF-8 are salvaged (``salvaged``), oversized bodies and decompression bombs get 413 while the
proxy's RSS stays bounded, streams and JSON cut short are ``truncated``, a client that stops
mid-body is a ``client_disconnect`` with its ``seq``, and SIGTERM drains calls in flight and gives
the rest a ``shutdown`` span.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import zlib
from pathlib import Path

import httpx
import pytest
from fixtures_compat import client_env
from fixtures_proxy import Recorder, StubServer, read_rewards, read_spans

from lightning_harness.schemas.rewards import MAX_REWARD_BYTES

pytestmark = pytest.mark.timeout(300)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
MiB = 1 << 20


def _url(p, rollout: str) -> str:
    return p.env_for(rollout)["OPENAI_BASE_URL"] + "/chat/completions"


def _post(url: str, **kw) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=120) as c:
        return c.post(url, **kw)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _spans_of(p, rollout: str, n: int = 1, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        got = [s for s in read_spans(p) if s["rollout_id"] == rollout]
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


# -- salvage -----------------------------------------------------------------------------------------
def test_request_with_invalid_utf8_is_refused_and_recorded_salvaged(proxy, stub_server):
    """vLLM refuses a body that is no text (400). Salvaged (U+FFFD) and rewritten with token ids
    asked for, it became a call the engine served; sent on as it came, it skipped every check that
    reads the request. The proxy refuses it (400) and its span keeps the salvaged text."""
    seen = len(stub_server.requests())
    raw = json.dumps(BODY).encode().replace(b'"hi"', b'"h\xffi"')
    r = _post(_url(proxy, "bad-req-bytes"), content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid text" in r.json()["error"]["message"]  # before the fix: 200
    (span,) = _spans_of(proxy, "bad-req-bytes")
    assert span["salvaged"] is True and span["error_kind"] == "malformed_request" and "not valid text" in span["error"]
    assert "h\ufffdi" in span["request_json"] and span["response_token_ids"] is None
    assert len(stub_server.requests()) == seen  # nothing sent


def test_the_bytes_of_a_lone_surrogate_are_read_as_the_engine_reads_them(proxy, stub_server):
    """``json.loads`` of a body's bytes (the engine's reader, and the stub's) lets the UTF-8 bytes of
    a lone surrogate through: the call is served, so it is read, injected and recorded as any other."""
    raw = json.dumps(BODY).encode()[:-1] + b', "x": "\xed\xa0\x80"}'
    r = _post(_url(proxy, "surrogate-bytes"), content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    (span,) = _spans_of(proxy, "surrogate-bytes")
    assert span["error_kind"] is None and span["response_token_ids"] == [100, 101, 102], span["error"]
    sent = stub_server.requests()[-1]
    assert sent["x"] == "\ud800" and sent["return_token_ids"] is True


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32-be"])
def test_a_body_the_engine_reads_in_another_unicode_encoding_is_recorded(proxy, stub_server, encoding):
    """vLLM reads a JSON body as ``json.loads`` of its bytes does: a UTF-8 byte-order mark, UTF-16 or
    UTF-32 are JSON to it. The proxy called them "not JSON": served, never recorded with token ids
    (a harness could hide its calls from training that way)."""
    rollout = f"enc-{encoding}"
    r = _post(_url(proxy, rollout), content=json.dumps(BODY).encode(encoding),
              headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    (span,) = _spans_of(proxy, rollout)
    assert span["error_kind"] is None and span["salvaged"] is False, span["error"]
    assert json.loads(span["request_json"]) == BODY and span["response_token_ids"] == [100, 101, 102]
    assert stub_server.requests()[-1]["return_token_ids"] is True


def test_lone_surrogate_escape_is_salvaged(proxy, stub_server):
    """A lone surrogate's escape is valid JSON with no UTF-8 form: the rewrite raised on it, so the
    call went upstream as sent (no token ids asked for, the model not mapped) while its span said
    token ids were injected. It is now written back as escapes."""
    raw = (b'{"model": "m\\ud800", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
           b'"user": "a\\udfffb"}')
    r = _post(_url(proxy, "surrogate"), content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    (span,) = _spans_of(proxy, "surrogate")
    assert span["salvaged"] is True and span["model"] == "m?"
    assert span["request_json"] == raw.decode()  # the escape itself is valid text: kept as sent
    assert span["token_ids_injected"] is True and span["response_token_ids"] == [100, 101]  # before: None
    sent = stub_server.requests()[-1]
    assert (sent["model"], sent["user"], sent["return_token_ids"]) == ("m\ud800", "a\udfffb", True)


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_answer_with_invalid_utf8_is_salvaged(proxy, stream):
    rollout = f"bad-answer-{stream}"
    r = _post(_url(proxy, rollout), json={**BODY, "stream": stream}, headers={"X-Stub-Bad-Utf8": "1"})
    assert r.status_code == 200
    (span,) = _spans_of(proxy, rollout)
    assert span["salvaged"] is True and span["error_kind"] is None, span["error"]
    assert "w0\ufffd" in span["response_json"]
    assert span["response_token_ids"] == [100, 101, 102]  # the event with the bad byte still counted


def test_deeply_nested_request_is_malformed_not_a_crash(proxy):
    raw = b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = _post(_url(proxy, "deep"), content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400  # the upstream's own answer: forwarded unchanged
    (span,) = _spans_of(proxy, "deep")
    assert span["error_kind"] == "malformed_request" and "not valid JSON" in span["error"]
    assert span["request_json"] == raw.decode() and proxy.control.state()["in_flight"] == 0


def test_clean_call_is_not_salvaged(proxy):
    assert _post(_url(proxy, "clean"), json=BODY).status_code == 200
    (span,) = _spans_of(proxy, "clean")
    assert span["salvaged"] is False and span["error_kind"] is None


# -- bounds --------------------------------------------------------------------------------------------
def test_oversized_body_gets_413_and_an_error_span(make_proxy):
    p = make_proxy(extra_args=["--max-body-size", str(MiB)])
    big = {**BODY, "messages": [{"role": "user", "content": "x" * (3 * MiB // 2)}]}  # within 2x: read, then 413
    r = _post(_url(p, "big"), json=big)
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "too_large" and "max_body_size" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: refused once the body is in
        data = json.dumps(big).encode()
        for i in range(0, len(data), 65536):
            yield data[i : i + 65536]

    r2 = _post(_url(p, "big"), content=chunked(), headers={"Content-Type": "application/json"})
    assert r2.status_code == 413
    assert _post(_url(p, "big"), json=BODY).status_code == 200  # the proxy still serves
    spans = _spans_of(p, "big", 3)
    assert [s["seq"] for s in spans] == [0, 1, 2]
    assert [s["error_kind"] for s in spans] == ["too_large", "too_large", None]
    assert spans[0]["status_code"] == 413 and spans[0]["request_json"] is None
    assert p.control.state()["rejected"] == 2


def _taken_before_cut(port: int, head: bytes, total: int, chunked: bool) -> tuple[int, bytes]:
    """Send ``head`` and then up to ``total`` body bytes (chunked, or as announced by ``head``) until
    the proxy stops taking them; return how many it took (the kernel's buffers included) and its answer."""
    piece = b"x" * 65536
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        try:
            while sent < total:
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                sent += len(piece)
            s.sendall(b"0\r\n\r\n" if chunked else b"")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # closed (or no longer read): the rest is not taken
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return sent, answer


@pytest.mark.parametrize("case", ["chunked model call", "no credentials", "control, no token", "chunked reward",
                                  "no model call", "forward, no model call"])
def test_a_body_past_its_bound_is_not_read_whole_however_it_comes(make_proxy, case):
    """mitmproxy holds a request body whole before any addon sees it, and answers a refusal made on
    the headers only once the body is in. A chunked model call announces no length, and a client
    with no credentials was refused 401 on its headers yet read whole: 64 MiB sent, 64 MiB (and more)
    of the proxy's memory. The proxy now stops reading past the call's bound and closes."""
    p = make_proxy(extra_args=["--max-body-size", str(MiB)])
    env = p.env_for("cut")
    model_path = urllib.parse.urlsplit(env["OPENAI_BASE_URL"]).path + "/chat/completions"
    reward_path = urllib.parse.urlsplit(env["LIGHTNING_REWARD_URL"]).path
    reverse, forward = p.config.reverse_port, p.config.forward_port
    engine = p.config.upstreams[0].display + "/collective_rpc"
    proxy_auth = "Proxy-Authorization: Basic " + base64.b64encode(
        urllib.parse.unquote(env["HTTP_PROXY"].split("//")[1].rsplit("@", 1)[0]).encode()).decode() + "\r\n"
    port, target, framing = {
        "chunked model call": (reverse, model_path, "Transfer-Encoding: chunked"),
        "no credentials": (reverse, "/v1/chat/completions", f"Content-Length: {64 * MiB}"),
        "control, no token": (forward, "http://lightning.proxy/_lh/state", "Transfer-Encoding: chunked"),
        "chunked reward": (reverse, reward_path, "Transfer-Encoding: chunked"),
        "no model call": (reverse, model_path.replace("/v1/chat/completions", "/collective_rpc"),
                          "Transfer-Encoding: chunked"),  # (the engine's administration: 403 once read)
        "forward, no model call": (forward, engine, proxy_auth + "Transfer-Encoding: chunked"),
    }[case]
    assert _post(_url(p, "warm"), json=BODY).status_code == 200
    before = _rss_mib(p.pid)
    Path(f"/proc/{p.pid}/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    head = f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
    taken, answer = _taken_before_cut(port, head.encode(), 64 * MiB, "chunked" in framing)
    peak = _hwm_mib(p.pid)
    assert taken < 24 * MiB, f"{taken} bytes taken"  # bound + the kernel's socket buffers
    assert peak - before < 32, f"RSS peak {peak:.0f} MiB vs {before:.0f} MiB before"
    status = b"401" if case in ("no credentials", "control, no token") else b"413"  # (refused on its headers:
    assert answer == b"" or answer.startswith(b"HTTP/1.1 " + status), answer[:200]  # that answer; a reset may beat it)
    assert _post(_url(p, "after"), json=BODY).status_code == 200  # the proxy still serves
    assert p.control.state()["rejected"] >= 1
    if case == "chunked model call":
        (span,) = _spans_of(p, "cut")
        assert span["error_kind"] == "too_large" and span["status_code"] == 413
        assert "past 2097152 bytes" in span["error"]


@pytest.mark.parametrize("size", [1000, 200_000, 5_000_000])
def test_a_client_without_credentials_hears_why_whatever_the_size_of_its_prompt(proxy, size):
    """A call refused on its headers is read to 64 KiB at most; past that the client got a 413 (the
    OpenAI SDK: ``APIStatusError: Error code: 413``) and looked for a prompt too large. It now gets the
    answer its headers got: 401, no rollout credentials."""
    openai = pytest.importorskip("openai")
    base = f"http://127.0.0.1:{proxy.config.reverse_port}/v1"
    client = openai.OpenAI(base_url=base, api_key="sk-x", max_retries=0, http_client=httpx.Client(trust_env=False))
    with pytest.raises(openai.AuthenticationError, match="no rollout credentials"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * size}])


def _stall(port: int, head: bytes, size: int) -> socket.socket | None:
    """A connection that sends ``head`` and all but the last byte of its ``size``-byte body, then
    waits; None when the proxy closed it first."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(head + b"x" * (size - 1))
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        s.close()
        return None
    return s


def test_a_rollouts_bodies_have_one_bound_however_many_connections_it_opens(make_proxy):
    """Each body is bounded, but mitmproxy holds every body whole before the budget
    (``max_inflight_bytes``) sees it: a rollout opening 96 connections that each send a body within
    ``max_body_size`` and hold back its last byte held 96 MiB of the proxy, and as many more as it
    opened (48 x 4 MiB here: +208 MiB). What a rollout's bodies hold in the proxy at once now has one
    bound (past it: 413, closed; +35 MiB here, what the connections' reads hold in passing); other
    rollouts are served meanwhile, and the bytes are the rollout's again once its calls end."""
    size = 4 * MiB
    p = make_proxy(extra_args=["--max-body-size", str(size), "--max-inflight-bytes", str(2 * size)])
    path = urllib.parse.urlsplit(_url(p, "many")).path
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    assert _post(_url(p, "warm"), json=BODY).status_code == 200
    before = _rss_mib(p.pid)
    Path(f"/proc/{p.pid}/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    held = [_stall(p.config.reverse_port, head, size) for _ in range(48)]
    try:
        time.sleep(1)  # (what the kernel buffered is read)
        peak = _hwm_mib(p.pid)
        assert peak - before < 64, f"RSS peak {peak:.0f} MiB vs {before:.0f} MiB before"
        assert _post(_url(p, "other"), json=BODY).status_code == 200  # another rollout is served
        big = {**BODY, "messages": [{"role": "user", "content": "x" * (3 * MiB)}]}
        assert _post(_url(p, "other"), json=big).status_code == 200
    finally:
        for s in held:
            if s is not None:
                s.close()
    def status(url, **kw):
        try:
            return _post(url, **kw).status_code
        except httpx.HTTPError as exc:  # (cut while sending)
            return repr(exc)

    deadline = time.monotonic() + 10  # the closed calls give their bytes back
    while (got := status(_url(p, "many"), json=big)) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert got == 200
    cut = [s for s in _spans_of(p, "many", 5) if s["error_kind"] == "too_large"]
    assert cut and "max_inflight_bytes" in cut[0]["error"], cut[:1]
    anonymous = f"http://127.0.0.1:{p.config.reverse_port}/v1/chat/completions"
    for _ in range(160):  # refused on their headers, read to 64 KiB: each gives its bytes back too (9.6 MB)
        assert status(anonymous, content=b"x" * 60_000) == 401


def test_control_calls_without_the_token_cannot_crowd_out_the_trainers(make_proxy):
    """A control call is refused on its headers without the control token (it was read first, up to
    twice max_body_size, and counted with every other call of no rollout): four such bodies held open
    by anyone on the machine filled that bound, and the trainer's own control calls were cut. Calls
    refused on their headers are counted apart from the calls that were not."""
    p = make_proxy(extra_args=["--max-body-size", str(MiB), "--max-inflight-bytes", str(2 * MiB)])
    head = (f"POST /_lh/reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {MiB}\r\n\r\n").encode()
    held = [_stall(p.config.reverse_port, head, MiB) for _ in range(4)]
    small = head.replace(str(MiB).encode(), b"61440")  # within what a refused call's body is read to
    held += [_stall(p.config.reverse_port, small, 61440) for _ in range(40)]  # 2.4 MB in all
    try:
        deadline = time.monotonic() + 10  # their bytes are in once 8 are cut (2.4 MB + 4 MiB, 2 MiB a bound)
        while p.control.state()["rejected"] < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert p.control.reward("r-ctl", 0, 1.0, {"note": "x" * 62_000})["ok"]  # (more than what is left)
    finally:
        for s in held:
            if s is not None:
                s.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_an_http2_body_past_its_bound_ends_its_stream_at_once(make_proxy, tmp_path):
    """The same bound for an HTTP/2 client (curl through the forward proxy, ALPN h2 in the tunnel)
    sending a body of no announced length from a pipe. The 413 went out, but the stream stayed open:
    curl waited for a window to send the rest in, until its own timeout. The stream is now reset."""
    p = make_proxy(extra_args=["--max-body-size", str(MiB)])
    assert _post(_url(p, "warm"), json=BODY).status_code == 200
    before = _rss_mib(p.pid)
    Path(f"/proc/{p.pid}/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    big = tmp_path / "big"
    big.write_bytes(b"x" * (64 * MiB))
    with subprocess.Popen(["cat", str(big)], stdout=subprocess.PIPE) as pipe:  # a pipe: no length to announce
        r = subprocess.run(["curl", "-sS", "--http2", "-o", "/dev/null", "-w", "%{http_code} %{http_version}",
                            "-H", "Content-Type: application/json", "-T", "-", "-X", "POST",
                            "https://api.openai.com/v1/chat/completions"],
                           env=client_env(p.env_for("h2-cut")), stdin=pipe.stdout, capture_output=True, text=True,
                           timeout=60)
    assert r.stdout == "413 2", (r.returncode, r.stdout, r.stderr)
    assert _hwm_mib(p.pid) - before < 32
    (span,) = _spans_of(p, "h2-cut")
    assert span["error_kind"] == "too_large" and "past 2097152 bytes; stream reset" in span["error"]
    assert _post(_url(p, "after"), json=BODY).status_code == 200


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_an_http2_call_refused_on_its_headers_hears_why_at_once(make_proxy, tmp_path):
    """Over HTTP/2 too, a call refused on its headers (a control call without the control token, in
    a harness's tunnel) gets its 401 and reason at once, whatever the size of the body it streams."""
    p = make_proxy(extra_args=["--max-body-size", str(MiB)])
    big = tmp_path / "big"
    big.write_bytes(b"x" * (64 * MiB))
    for size in (1000, 64 * MiB):
        with subprocess.Popen(["head", "-c", str(size), str(big)], stdout=subprocess.PIPE) as pipe:
            r = subprocess.run(["curl", "-sS", "--http2", "-w", " %{http_code} %{http_version}", "-T", "-", "-X",
                                "POST", "https://lightning.proxy/_lh/flush"],
                               env=client_env(p.env_for("h2-refused")), stdin=pipe.stdout, capture_output=True,
                               text=True, timeout=60)
        assert r.stdout.endswith(" 401 2") and "needs Authorization: Bearer" in r.stdout, (size, r.stdout, r.stderr)


def test_an_upload_through_the_forward_proxy_streams_through(make_proxy):
    """Other traffic (not recorded) to a host that is not the pool's is not held: mitmproxy read an
    upload whole first (64 MiB: the proxy's peak +209 MiB), as large as a harness chose."""
    p = make_proxy(extra_args=["--max-body-size", str(MiB)])
    elsewhere = Recorder()
    try:
        with httpx.Client(proxy=p.env_for("up")["HTTP_PROXY"], trust_env=False, timeout=120) as c:
            assert c.post(elsewhere.url + "/upload", content=b"warm").status_code == 200
            assert elsewhere.seen[-1]["body"] == "warm"
            before = _rss_mib(p.pid)
            Path(f"/proc/{p.pid}/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
            r = c.post(elsewhere.url + "/upload", content=b"x" * (64 * MiB))
        peak = _hwm_mib(p.pid)
        assert r.status_code == 200 and len(elsewhere.seen[-1]["body"]) == 64 * MiB  # all of it, past max_body_size
        assert peak - before < 32, f"RSS peak {peak:.0f} MiB vs {before:.0f} MiB before"
    finally:
        elsewhere.close()


def test_gzip_bomb_gets_413_with_bounded_memory(proxy, stub_server):
    bomb = gzip.compress(b" " * (200 * MiB), compresslevel=9)
    assert len(bomb) < 300 * 1024
    assert _post(_url(proxy, "warm"), json=BODY).status_code == 200
    before = _rss_mib(proxy.pid)
    Path(f"/proc/{proxy.pid}/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    r = _post(_url(proxy, "bomb"), content=bomb,
              headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 413 and "max_decoded_size" in r.json()["error"]["message"]
    peak = _hwm_mib(proxy.pid)
    assert peak - before < 32, f"RSS peak {peak:.0f} MiB vs {before:.0f} MiB before"  # measured first, never held
    (span,) = _spans_of(proxy, "bomb")
    assert span["error_kind"] == "too_large" and span["seq"] == 0


def test_a_harness_reward_is_bounded_raw_and_decoded(proxy):
    """A reward is a number and a little info (``MAX_REWARD_BYTES``, the reward file's bound). A gzip
    body POSTed to LIGHTNING_REWARD_URL was expanded without a cap (300 KB -> 300 MB: 3.5 GB peak,
    other rollouts' calls stalled 18 s) and stored whole in the rewards table the launcher reads."""
    url = proxy.env_for("reward-bomb")["LIGHTNING_REWARD_URL"]
    bomb = gzip.compress(json.dumps({"reward": 1.0, "info": {"x": " " * (64 * MiB)}}).encode(), compresslevel=9)
    gz = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    before = _rss_mib(proxy.pid)
    Path(f"/proc/{proxy.pid}/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    r = _post(url, content=bomb, headers=gz)
    assert r.status_code == 413 and str(MAX_REWARD_BYTES) in r.text, r.text
    assert _hwm_mib(proxy.pid) - before < 32
    assert _post(url, json={"reward": 1.0, "info": {"x": "y" * MAX_REWARD_BYTES}}).status_code == 413
    u = urllib.parse.urlsplit(url)  # announced far past the bound: closed at once, the body never read
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(f"POST {u.path} HTTP/1.1\r\nHost: x\r\nContent-Length: {1 << 30}\r\n\r\n".encode())
        assert s.recv(4096) == b""
    ok = gzip.compress(json.dumps({"reward": 0.5, "info": {"passed": 3}}).encode())
    assert _post(url, content=ok, headers=gz).status_code == 200  # a small compressed reward still counts
    assert [(w["rollout_id"], w["reward"], w["info_json"]) for w in read_rewards(proxy)] == [
        ("reward-bomb", 0.5, '{"passed": 3}')]


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_compressed_request_is_forwarded_decoded(proxy, stub_server, coding):
    data = json.dumps({**BODY, "max_tokens": 2}).encode()
    blob = gzip.compress(data) if coding == "gzip" else zlib.compress(data)
    r = _post(_url(proxy, f"zip-{coding}"), content=blob,
              headers={"Content-Type": "application/json", "Content-Encoding": coding})
    assert r.status_code == 200, r.text
    (span,) = _spans_of(proxy, f"zip-{coding}")
    assert span["error_kind"] is None and json.loads(span["request_json"])["max_tokens"] == 2
    assert stub_server.requests()[-1]["max_tokens"] == 2  # upstream got plain JSON


@pytest.mark.parametrize("accept", ["identity", "gzip"])
def test_compressed_answer_bomb_is_capped(make_proxy, accept):
    p = make_proxy(extra_args=["--max-decoded-size", str(MiB)])
    headers = {"X-Stub-Encoding": "gzip", "X-Stub-Pad": str(8 * MiB), "Accept-Encoding": accept}
    before = _rss_mib(p.pid)
    with httpx.Client(trust_env=False, timeout=120) as c:
        r = c.post(_url(p, "answer-bomb"), json=BODY, headers=headers)
        # a harness that accepts gzip gets the body as upstream sent it; one that does not gets 502
        assert r.status_code == (200 if accept == "gzip" else 502)
    (span,) = _spans_of(p, "answer-bomb")
    assert span["error_kind"] == "too_large" and "max_decoded_size" in span["error"]
    assert span["status_code"] == r.status_code  # what the harness got
    assert _hwm_mib(p.pid) - before < 64


# -- error kinds -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False])
def test_answer_cut_short_is_truncated(proxy, stream):
    rollout = f"cut-{stream}"
    r = _post(_url(proxy, rollout), json={**BODY, "stream": stream}, headers={"X-Stub-Truncate": "1"})
    assert r.status_code == 200
    (span,) = _spans_of(proxy, rollout)
    assert span["error_kind"] == "truncated", span["error"]
    assert "incomplete" in span["error"] and span["status_code"] == 200
    if stream:
        assert span["response_token_ids"] == [100]  # what had arrived is kept


def _raw_partial_post(p, rollout: str, send: int, announce: int) -> None:
    """Announce ``announce`` body bytes, send ``send`` of them, hang up."""
    u = urllib.parse.urlsplit(_url(p, rollout))
    head = (f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {announce}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(head + b"x" * send)
        time.sleep(0.3)


def test_a_body_announced_far_over_the_limit_is_never_read(make_proxy):
    """Content-Length over twice max_body_size: the proxy closes the connection without reading the
    body (a 413 would first buffer all of it), records a too_large span, and keeps serving."""
    p = make_proxy(extra_args=["--max-body-size", str(MiB)])
    u = urllib.parse.urlsplit(_url(p, "huge"))
    announce = 10 << 30  # 10 GiB announced
    head = (f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {announce}\r\n\r\n").encode()
    sent = 0
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(head)
        with pytest.raises(OSError):  # reset or broken pipe long before 10 GiB
            while sent < 256 * MiB:
                s.sendall(b"x" * MiB)
                sent += MiB
            raise AssertionError(f"the proxy read {sent} bytes of an announced {announce}")
    assert _post(_url(p, "huge"), json=BODY).status_code == 200
    spans = _spans_of(p, "huge", 2)
    assert [(s["seq"], s["error_kind"]) for s in spans] == [(0, "too_large"), (1, None)]
    assert "never" in spans[0]["error"] or "without reading" in spans[0]["error"]
    assert _hwm_mib(p.pid) < 400


def test_client_stopping_mid_body_is_client_disconnect_with_seq(proxy):
    url = _url(proxy, "quitter")
    _raw_partial_post(proxy, "quitter", send=100, announce=5000)
    assert _post(url, json=BODY).status_code == 200
    spans = _spans_of(proxy, "quitter", 2)
    assert [(s["seq"], s["error_kind"]) for s in spans] == [(0, "client_disconnect"), (1, None)]
    assert "request body" in spans[0]["error"]
    assert proxy.control.state()["in_flight"] == 0


def test_sigterm_drains_then_records_shutdown_spans(tmp_path, make_proxy):
    from lightning_harness.schemas import read_table

    slow = StubServer(tmp_path)
    try:
        p = make_proxy(upstreams=[slow.url], extra_args=["--shutdown-grace", "3"])
        results = {}

        def call(name, delay):
            try:
                results[name] = _post(_url(p, name), json=BODY, headers={"X-Stub-Delay": str(delay)}).status_code
            except httpx.HTTPError as exc:
                results[name] = type(exc).__name__

        threads = [threading.Thread(target=call, args=a) for a in (("quick", 1.0), ("stuck", 60.0))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while p.control.state()["in_flight"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        os.killpg(p.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        late = _post(_url(p, "late"), json=BODY)  # the door is closed while draining
        assert late.status_code == 503 and late.json()["error"]["type"] == "shutdown"
        assert p.proc.wait(15) == 0
        assert 2.5 < time.monotonic() - t0 < 15  # waited for the grace, not for the stuck call
        for t in threads:
            t.join(30)
        assert results["quick"] == 200  # finished within the grace: answered and recorded normally
        rows = {r["rollout_id"]: r for r in read_table(p.traces_dir, "spans").to_pylist()}
        assert rows["quick"]["error_kind"] is None and rows["quick"]["response_token_ids"] == [100, 101, 102]
        assert rows["stuck"]["error_kind"] == "shutdown" and rows["stuck"]["seq"] == 0
        assert "shut down" in rows["stuck"]["error"]
        assert rows["late"]["error_kind"] == "shutdown" and rows["late"]["status_code"] == 503
    finally:
        slow.stop()


# -- pure parts ------------------------------------------------------------------------------------------
def test_sse_relay_split_anywhere_gives_the_same_events():
    from lightning_harness.proxy.sse import SSERelay

    events = [{"i": i, "s": "é" * i} for i in range(20)]
    # every blank line the SSE spec allows (a line ends with CRLF, LF or CR); CR CR and LF CRLF held a
    # whole stream back, unparsed and unstripped, until a review found them
    ends = (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n", b"\n\r", b"\r\r\n")
    data = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + ends[i % len(ends)]
                    for i, e in enumerate(events)) + b"data: [DONE]\n\n"
    for step in (1, 2, 3, 7, 64, len(data)):
        got = []
        relay = SSERelay(got.append, [lambda o: o])  # a filter: events are re-serialised
        pieces = [relay(data[i : i + step]) for i in range(0, len(data), step)] + [relay(b"")]
        out = b"".join(x if isinstance(x, bytes) else b"".join(x) for x in pieces)
        assert got == events and relay.done, step
        assert out.count(b"data: ") == 21 and out.endswith(b"data: [DONE]\n\n")
        assert out.replace(b" ", b"") == data.replace(b" ", b""), step  # the same bytes but for JSON spacing


def test_sse_relay_caps_one_event():
    from lightning_harness.proxy.sse import SSERelay

    errors = []
    relay = SSERelay(lambda o: None, on_error=errors.append, max_event=1000)
    first = b'data: {"a": 1}\n\ndata: {"b": "' + b"x" * 2000
    assert relay(first) == first  # relayed as is, never held back
    assert relay.oversize and "longer than 1000 bytes" in errors[0] and relay.events == 1
    assert relay(b'"}\n\n') == b'"}\n\n'
    rewriting = SSERelay(lambda o: None, [lambda o: {k: v for k, v in o.items() if k != "a"}], max_event=1000)
    assert rewriting(first) == b'data: {}\n\n' + first[len(b'data: {"a": 1}\n\n'):]  # held part released
    assert rewriting(b'"}\n\n') == b'"}\n\n' and rewriting.oversize


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_decode_body_caps_a_bomb(coding):
    from lightning_harness.proxy.codec import TooLarge, decode_body

    plain = b"\0" * (64 * MiB)
    blob = gzip.compress(plain) if coding == "gzip" else zlib.compress(plain)
    with pytest.raises(TooLarge):
        decode_body(blob, coding, 8 * MiB)
    assert decode_body(blob, coding, 64 * MiB) == plain
    with pytest.raises(ValueError, match="unsupported"):
        decode_body(blob, "compress", MiB)


def test_assemblers_know_a_finished_stream():
    from lightning_harness.proxy.assemble import ResponsesAssembler, StreamAssembler

    chat = StreamAssembler("chat.completions")
    chat.add({"choices": [{"index": 0, "delta": {"content": "a"}}]})
    assert not chat.finished
    chat.add({"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "stop"}]})
    assert chat.finished and chat.result()["choices"][0]["message"]["content"] == "ab"
    resp = ResponsesAssembler()
    resp.add({"type": "response.output_text.delta", "delta": "a"})
    assert not resp.finished
    resp.add({"type": "response.completed", "response": {"status": "completed", "output": []}})
    assert resp.finished


def test_a_chat_choice_ends_with_its_final_chunk():
    """What a hostile upstream sends for a choice after its finish_reason chunk (more text and ids,
    another finish reason) was added to it, and a later usage replaced the answer's; another
    choice still going, the usage-only chunk vLLM sends after the last final chunk, and an error
    chunk (the answer is no clean one) still count."""
    from lightning_harness.proxy.assemble import StreamAssembler, token_fields

    def chunk(i, content, ids, finish=None, **extra):
        return {"choices": [{"index": i, "delta": {"content": content}, "token_ids": ids, "finish_reason": finish}],
                **extra}

    asm = StreamAssembler("chat.completions")
    for c in [chunk(0, "a", [1]), chunk(1, "x", [7]), chunk(0, "b", [2], "stop"), chunk(0, "LATE", [9], "length"),
              chunk(1, "y", [8], "length"), {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 4}},
              chunk(0, "AGAIN", [9], usage={"prompt_tokens": 99, "completion_tokens": 99})]:
        asm.add(c)
    out = asm.result()
    assert [(ch["message"]["content"], ch["token_ids"], ch["finish_reason"]) for ch in out["choices"]] == [
        ("ab", [1, 2], "stop"), ("xy", [7, 8], "length")]
    assert token_fields(out, "chat.completions")["prompt_tokens"] == 4 and asm.error is None
    asm.add({"error": {"message": "engine died"}})
    assert "engine died" in asm.error


def test_hostile_answer_fields_do_not_reach_the_columns():
    from lightning_harness.proxy.assemble import StreamAssembler, token_fields

    asm = StreamAssembler("chat.completions")
    asm.add({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 10 ** 9, "function": {"arguments": "x"}}]}}]})
    assert asm.result()["choices"][0]["message"]["tool_calls"] == []  # no list of 10**9 placeholders
    obj = {"choices": [{"index": 0, "finish_reason": {"x": 1}, "token_ids": [1, 2 ** 40]}],
           "usage": {"prompt_tokens": 10 ** 12, "completion_tokens": "7"}}
    out = token_fields(obj, "chat.completions")
    assert out["salvaged"] is True
    assert out["finish_reason"] is None and out["prompt_tokens"] is None and out["completion_tokens"] is None
    assert out["response_token_ids"] is None
    assert token_fields({"choices": {"0": {}}}, "chat.completions")["n_choices"] is None


def test_big_download_through_the_forward_proxy_is_streamed(proxy, tmp_path):
    """Other traffic is not captured; a 200 MiB download (from another host than the engine, whose
    reads are only a client's) must not sit whole in the proxy."""
    env = proxy.env_for("downloader")
    before = _rss_mib(proxy.pid)
    Path(f"/proc/{proxy.pid}/clear_refs").write_text("5")
    got = 0
    elsewhere = StubServer(tmp_path)
    try:
        with httpx.Client(proxy=env["HTTP_PROXY"], trust_env=False, timeout=120) as c:
            with c.stream("GET", f"{elsewhere.url}/_stub/blob?bytes={200 * MiB}") as r:
                assert r.status_code == 200
                for piece in r.iter_raw():
                    got += len(piece)
    finally:
        elsewhere.stop()
    assert got == 200 * MiB
    assert _hwm_mib(proxy.pid) - before < 64
    assert [s for s in read_spans(proxy) if s["rollout_id"] == "downloader"] == []  # not a model call


def test_nested_body_with_secret_words_still_gets_a_span(proxy):
    """Redaction re-parses bodies that hold a known secret; a nesting bomb must not lose the span."""
    # 700 deep parses (json's C scanner), but a recursive walk would need two Python frames a level
    key = "hk-Deep7secretValue9forTheNestingBomb"
    raw = b'{"model": "m", "api_key": "' + key.encode() + b'", "x": ' + b"[" * 700 + b"1" + b"]" * 700 + b"}"
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    _post(_url(proxy, "deep-secret"), content=raw, headers=headers)
    (span,) = _spans_of(proxy, "deep-secret")
    assert span["seq"] == 0 and span["secret_detected"] is True
    assert key not in (span["request_json"] or "")


def test_sigterm_mid_stream_keeps_what_had_streamed(tmp_path, make_proxy):
    from lightning_harness.schemas import read_table

    slow = StubServer(tmp_path, args=["--chunk-delay", "0.4"])
    try:
        p = make_proxy(upstreams=[slow.url], extra_args=["--shutdown-grace", "1"])
        seen = threading.Event()

        def stream():
            try:
                with httpx.Client(trust_env=False, timeout=60) as c:
                    with c.stream("POST", _url(p, "streaming"), json={**BODY, "max_tokens": 50, "stream": True}) as r:
                        for line in r.iter_lines():
                            if "w1" in line:
                                seen.set()
            except httpx.HTTPError:
                pass  # the proxy closes the stream when it stops

        t = threading.Thread(target=stream)
        t.start()
        assert seen.wait(30)
        assert p.stop() == 0
        t.join(30)
        (row,) = read_table(p.traces_dir, "spans").to_pylist()
        assert row["error_kind"] == "shutdown" and row["stream"] is True
        assert row["response_token_ids"][:2] == [100, 101]  # the tokens relayed before the stop
    finally:
        slow.stop()


def test_large_bodies_beyond_the_inflight_budget_wait_their_turn(tmp_path, make_proxy):
    """Two 600 KB calls under a 1 MiB budget run one after the other; a small call is not held."""
    slow = StubServer(tmp_path, args=["--delay", "1.5"])
    try:
        p = make_proxy(upstreams=[slow.url], extra_args=["--max-inflight-bytes", str(MiB)])
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 600_000}]}
        done = {}

        def call(name, body):
            done[name] = (_post(_url(p, name), json=body).status_code, time.monotonic())

        threads = [threading.Thread(target=call, args=(n, big)) for n in ("big-a", "big-b")]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(0.3)
        done["small"] = (_post(_url(p, "small"), json=BODY, headers={"X-Stub-Delay": "0"}).status_code,
                         time.monotonic())
        for t in threads:
            t.join(60)
        assert {k: v[0] for k, v in done.items()} == {"big-a": 200, "big-b": 200, "small": 200}
        first, second = sorted(done[k][1] - t0 for k in ("big-a", "big-b"))
        assert second - first > 1.2  # the second big body went upstream only after the first was done
        # the small call (answered at once upstream) did not queue behind them: done before either
        assert done["small"][1] - t0 < first
        assert len(_spans_of(p, "big-b")) == 1 and len(_spans_of(p, "big-a")) == 1
    finally:
        slow.stop()


def test_one_rollouts_big_calls_do_not_stall_another_rollouts(tmp_path, make_proxy):
    """Finding F6: rollout "hog" sends three 600 KB calls whose answers take 6 s each; they fit the
    2 MiB budget together, so before the fix they took all of it and rollout "other"'s 300 KB call
    waited for one to end. Now the hog's extra calls only use the first half: "other" goes at once,
    and the hog's calls, run one at a time, all still succeed and are recorded once each."""
    p = make_proxy(extra_args=["--max-inflight-bytes", str(2 * MiB)])
    done = {}

    def call(name, rollout, size, delay):
        body = {**BODY, "messages": [{"role": "user", "content": "x" * size}]}
        r = _post(_url(p, rollout), json=body, headers={"X-Stub-Delay": str(delay)})
        done[name] = (r.status_code, time.monotonic())

    hogs = [threading.Thread(target=call, args=(f"hog{i}", "hog", 600_000, 6)) for i in range(3)]
    t0 = time.monotonic()
    for t in hogs:
        t.start()
    time.sleep(1.5)  # the hog's calls are in the proxy: one upstream, two waiting (before: three upstream)
    call("other", "other", 300_000, 0)
    for t in hogs:
        t.join(120)
    assert {k: v[0] for k, v in done.items()} == {"hog0": 200, "hog1": 200, "hog2": 200, "other": 200}
    hog_ends = sorted(done[f"hog{i}"][1] - t0 for i in range(3))
    assert done["other"][1] - t0 < hog_ends[0] - 1  # answered well before even the first hog call ended
    assert hog_ends[2] - hog_ends[0] > 6  # the hog's calls went one after another, not all at once
    assert len(_spans_of(p, "other")) == 1
    spans = _spans_of(p, "hog", n=3)
    assert len(spans) == 3 and sorted(s["seq"] for s in spans) == [0, 1, 2]


def test_a_server_the_harness_runs_itself_is_recorded_as_such_and_not_waited_for(tmp_path, make_proxy):
    """Forward mode to a host outside the configuration (a harness's own OpenAI-shaped server): the
    span says ``routed`` false and keeps no token ids or logprobs (they are whatever that server made
    up, and training used them), and a swap's drain does not wait for such a call (it held every
    harness's calls until the drain timed out)."""
    fake = StubServer(tmp_path)
    try:
        p = make_proxy()
        env = p.env_for("own-server")
        body = {**BODY, "return_token_ids": True, "logprobs": True}
        done = {}

        def slow():
            with httpx.Client(proxy=env["HTTP_PROXY"], trust_env=False, timeout=60) as c:
                done["slow"] = c.post(fake.url + "/v1/chat/completions", json=body,
                                      headers={"X-Stub-Delay": "6"}).status_code

        t = threading.Thread(target=slow)
        t.start()
        time.sleep(1.0)
        started = time.monotonic()
        drained = p.control.drain(timeout=4)
        assert drained["drained"] is True and time.monotonic() - started < 3, drained
        t.join(60)
        assert done == {"slow": 200}
        (got,) = _spans_of(p, "own-server")
        assert got["routed"] is False and got["upstream"] == fake.url
        assert (got["prompt_token_ids"], got["response_token_ids"], got["response_logprobs"]) == (None, None, None)
        assert _post(_url(p, "pool"), json=BODY).status_code == 200
        (pooled,) = _spans_of(p, "pool")
        assert pooled["routed"] is True and pooled["response_token_ids"]
    finally:
        fake.stop()


def test_without_a_pool_a_route_host_is_the_operators_choice(tmp_path, make_proxy):
    """Capture only, forward mode (no pool): a call to a configured route host is recorded as routed
    (with whatever ids it returned); one to any other host is the harness's choice."""
    fake = StubServer(tmp_path)
    try:
        p = make_proxy(upstreams=[], route_hosts=["localhost"])
        env = p.env_for("capture")
        body = {**BODY, "return_token_ids": True, "logprobs": True}
        port = fake.url.rsplit(":", 1)[1]
        with httpx.Client(proxy=env["HTTP_PROXY"], trust_env=False, timeout=60) as c:
            for host in ("localhost", "127.0.0.1"):
                assert c.post(f"http://{host}:{port}/v1/chat/completions", json=body).status_code == 200
        spans = _spans_of(p, "capture", 2)
        assert [(s["host"].split(":")[0], s["routed"], bool(s["response_token_ids"])) for s in spans] == [
            ("localhost", True, True), ("127.0.0.1", False, False)]
    finally:
        fake.stop()
