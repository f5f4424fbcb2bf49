"""Capture never stops silently: the real proxy process against bad bytes and a real full disk.

Invalid UTF-8 in a request or in an upstream answer must not block later spans; a full disk must
show in /_lh/state, make model calls fail with 503 (policy reject) or be counted (policy serve),
leave no temp file, and lose nothing accepted once space returns. The loop/launcher health check
stops on such a proxy.
"""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest
from fixtures_proxy import read_spans

from lightning_harness.proxy.client import ProxyError
from lightning_harness.proxy.health import CaptureUnhealthy, require_capture
from lightning_harness.schemas import read_table

pytestmark = pytest.mark.timeout(180)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _post(p, rollout: str, **kw) -> httpx.Response:
    url = p.env_for(rollout)["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c:
        return c.post(url, **kw) if kw else c.post(url, json=BODY)


def _wait(cond, what: str, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.1)


class _BadBytesUpstream(http.server.BaseHTTPRequestHandler):
    """Answers every POST with a 200 JSON completion whose content holds a byte that is not UTF-8."""

    def do_POST(self):  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = (b'{"id": "x", "object": "chat.completion", "model": "m", "choices": [{"index": 0, '
                b'"message": {"role": "assistant", "content": "bad \xff byte"}, "finish_reason": "stop"}]}')
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def bad_bytes_upstream():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BadBytesUpstream)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_invalid_utf8_request_does_not_block_later_spans(proxy):
    bad = b'{"model": "m", "messages": [{"role": "user", "content": "bad \xff byte"}], "max_tokens": 2}'
    _post(proxy, "bad-req", content=bad, headers={"Content-Type": "application/json"})
    for i in range(3):
        assert _post(proxy, f"after-{i}").status_code == 200
    st = _wait(lambda: (s := proxy.control.state())["spans_written"] >= 4 and s, "4 spans written")
    assert st["healthy"] and st["spans_pending"] == 0 and st["rows_lost"] == 0
    rows = {r["rollout_id"]: r for r in read_spans(proxy)}
    assert sorted(rows) == ["after-0", "after-1", "after-2", "bad-req"]
    assert rows["bad-req"]["salvaged"] is True and "\ufffd" in rows["bad-req"]["request_json"]
    assert not any(rows[f"after-{i}"]["salvaged"] for i in range(3))


def test_invalid_utf8_upstream_answer_does_not_block_later_spans(make_proxy, bad_bytes_upstream):
    p = make_proxy(upstreams=[bad_bytes_upstream])
    assert _post(p, "bad-resp").status_code == 200
    assert _post(p, "after").status_code == 200
    _wait(lambda: p.control.state()["spans_written"] >= 2, "2 spans written")
    rows = {r["rollout_id"]: r for r in read_spans(p)}
    assert rows["bad-resp"]["salvaged"] is True and "bad \ufffd byte" in rows["bad-resp"]["response_json"]
    assert p.control.state()["healthy"]


def test_full_disk_rejects_calls_then_recovers_without_loss(make_proxy, small_disk):
    traces = small_disk.path / "traces"
    p = make_proxy(traces_dir=traces, flush_seconds=0.2)
    assert _post(p, "before").status_code == 200
    _wait(lambda: p.control.state()["spans_written"] == 1, "first span written")
    small_disk.fill()
    accepted = 1
    r = _post(p, "during")  # accepted: the writer learns of the full disk at its next flush
    assert r.status_code == 200
    accepted += 1
    st = _wait(lambda: (s := p.control.state())["healthy"] is False and s, "state shows unhealthy")
    assert "No space" in st["capture_error"] and st["write_failures"] >= 1 and st["spans_pending"] == 1
    r = _post(p, "rejected")
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "capture_unavailable" and "No space" in r.json()["error"]["message"]
    assert p.control.state()["capture_rejected"] == 1
    with pytest.raises(CaptureUnhealthy, match="No space"):
        require_capture(p.control)  # what the loop and the launcher run after a rollout phase
    assert small_disk.temp_files() == []
    small_disk.free()
    st = _wait(lambda: (s := p.control.state())["healthy"] and s["spans_pending"] == 0 and s, "recovered", 60)
    assert _post(p, "after").status_code == 200
    accepted += 1
    require_capture(p.control)
    ids = sorted(r["rollout_id"] for r in read_table(traces, "spans").to_pylist())
    assert ids == ["after", "before", "during"] and len(ids) == accepted
    assert small_disk.temp_files() == []


def test_full_disk_serve_policy_forwards_and_counts_dropped_spans(make_proxy, small_disk):
    p = make_proxy(traces_dir=small_disk.path / "traces", flush_seconds=0.2,
                   extra_args=["--capture-failure", "serve", "--max-buffer-bytes", "3000"])
    small_disk.fill()
    big = dict(BODY, messages=[{"role": "user", "content": "x" * 4000}])
    assert _post(p, "kept", json=big).status_code == 200  # buffered (an empty buffer takes any row)
    _wait(lambda: p.control.state()["healthy"] is False, "unhealthy")
    assert _post(p, "dropped").status_code == 200  # served, not recorded: counted
    st = p.control.state()
    assert st["capture_failure"] == "serve" and st["spans_dropped"] == 1 and st["capture_rejected"] == 0
    with pytest.raises(CaptureUnhealthy, match="1 spans dropped"):
        require_capture(p.control)
    assert "span not recorded (dropped~0 seq 0)" in p.log_path.read_text()
    small_disk.free()
    st = _wait(lambda: (s := p.control.state())["healthy"] and s["spans_pending"] == 0 and s, "recovered", 60)
    assert [r["rollout_id"] for r in read_table(small_disk.path / "traces", "spans").to_pylist()] == ["kept"]
    assert st["spans_captured"] == st["spans_written"] + st["spans_pending"] + st["spans_dropped"] == 2


def test_out_of_range_attempt_and_model_version_are_refused_at_the_door(proxy):
    """Numbers the columns cannot hold never reach the writer (400); later spans are unaffected.

    The writer's own salvage of such values (null + salvaged) is covered in test_hostile_writer.
    """
    bearer = {"Authorization": f"Bearer {proxy.control_token}"}
    with httpx.Client(trust_env=False, timeout=60) as c:  # raw: ProxyControl refuses it before sending
        answer = c.post(proxy.reverse_url + "/_lh/model_version", json={"version": 2**70}, headers=bearer)
    assert answer.status_code == 400 and "model version" in answer.text
    url = proxy.env_for("huge", attempt=0)["OPENAI_BASE_URL"].replace("huge~0", f"huge~{2**70}")
    with httpx.Client(trust_env=False, timeout=60) as c:
        answer = c.post(url + "/chat/completions", json=BODY)
    assert answer.status_code == 400 and "attempt" in answer.text
    proxy.control.set_model_version(1)
    assert _post(proxy, "after").status_code == 200
    rows = {r["rollout_id"]: r for r in read_spans(proxy)}
    assert set(rows) == {"after"}
    assert rows["after"]["model_version"] == 1 and not rows["after"]["salvaged"]
    assert proxy.control.state()["healthy"]


def test_a_harness_client_retries_through_a_full_disk(make_proxy, small_disk, openai_from_env):
    """The official client honours 503 + Retry-After: the call succeeds once space returns, recorded."""
    traces = small_disk.path / "traces"
    p = make_proxy(traces_dir=traces, flush_seconds=0.2)
    small_disk.fill()
    assert _post(p, "first").status_code == 200
    _wait(lambda: p.control.state()["healthy"] is False, "unhealthy")
    threading.Timer(1.5, small_disk.free).start()
    client = openai_from_env(p.env_for("retrying")).with_options(max_retries=8)
    reply = client.chat.completions.create(model="m", messages=BODY["messages"], max_tokens=2)
    assert reply.choices[0].message.content
    st = p.control.state()
    assert st["capture_rejected"] >= 1 and st["healthy"]
    _wait(lambda: p.control.state()["spans_pending"] == 0, "everything written")
    assert sorted(r["rollout_id"] for r in read_table(traces, "spans").to_pylist()) == ["first", "retrying"]


def test_rewards_on_a_full_buffer_get_503_and_shutdown_reports_what_is_lost(make_proxy, small_disk):
    p = make_proxy(traces_dir=small_disk.path / "traces", flush_seconds=0.2, extra_args=["--max-buffer-bytes", "3000"])
    small_disk.fill()
    big = {"note": "x" * 4000}
    p.control.reward("r", 0, 1.0, big)  # an empty buffer takes it
    _wait(lambda: p.control.state()["healthy"] is False, "unhealthy")
    with pytest.raises(ProxyError, match="503"):
        p.control.reward("r", 0, 0.5, big)
    assert p.control.state()["rewards_refused"] == 1
    p.stop()  # SIGTERM with the disk still full: the loss is reported, not hidden
    assert "1 rewards row(s) could not be written at shutdown" in p.log_path.read_text()
    assert small_disk.temp_files() == []


def test_capture_failure_policy_is_validated():
    from lightning_harness.proxy.config import ProxyConfig

    assert ProxyConfig.from_mapping({}).capture_failure == "reject"
    assert ProxyConfig.from_mapping({"capture_failure": "serve"}).capture_failure == "serve"
    with pytest.raises(ValueError, match="capture_failure must be one of \\['reject', 'serve'\\]"):
        ProxyConfig.from_mapping({"capture_failure": "drop"})
