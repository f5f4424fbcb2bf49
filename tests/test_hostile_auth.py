"""A hostile harness (issue 10): it holds only its Contract 2 environment and tries to do more.

Real proxy process, real httpx/urllib clients, the real launcher; an upstream that records every
request it receives shows that nothing refused or control-related ever left the proxy.
"""

from __future__ import annotations

import ast
import base64
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from functools import partial
from pathlib import Path

import httpx
import pytest
from fixtures_proxy import Recorder, read_rewards, read_spans

from lightning_harness.proxy.client import ProxyControl, ProxyError, harness_env
from lightning_harness.proxy.credentials import (
    MAX_ATTEMPT,
    InvalidId,
    Revocations,
    attempt_credential,
    check_rollout_id,
    parse_user,
)
from lightning_harness.proxy.locate import proxy_python

pytestmark = pytest.mark.timeout(300)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def credential_of(env: dict) -> str:
    """What the harness holds: the password of its HTTP_PROXY (= the /lh/ segment)."""
    return urllib.parse.unquote(urllib.parse.urlsplit(env["HTTP_PROXY"]).password)


def secrets_of(p) -> list[str]:
    return [p.token, p.control_token]


@pytest.fixture
def recorder():
    r = Recorder()
    yield r
    r.close()


# -- the rule, defined once -----------------------------------------------------------------------
def test_id_rules_name_themselves():
    assert parse_user("run-1.a_b~7") == ("run-1.a_b", 7)
    assert parse_user("plain") == ("plain", 0)
    for bad in ("a\r\nb", "a\x00", "x" * 256, "", "a b", "a/b", "a~b~1", "a~-1", f"a~{MAX_ATTEMPT + 1}",
                "a~" + "9" * 30):
        with pytest.raises(InvalidId, match=r"rollout id is 1\.\.255 characters|attempt is an integer"):
            parse_user(bad)
    with pytest.raises(InvalidId, match=r"\\r\\n"):  # messages escape what they quote
        check_rollout_id("a\r\nb")
    # credentials: bound to rollout~attempt, different per attempt, url-safe, 192 bits
    c = attempt_credential("tok", "r", 0)
    assert len(c) == 32 and c == attempt_credential("tok", "r", 0)
    assert len({c, attempt_credential("tok", "r", 1), attempt_credential("tok", "r2", 0),
                attempt_credential("tok2", "r", 0)}) == 4
    assert urllib.parse.quote(c, safe="") == c


def test_revocations_stay_bounded():
    r = Revocations(limit=3)
    for i in range(5):
        r.revoke(f"r{i}", 0)
    assert len(r) == 3 and r.forgotten == 2
    assert ("r4", 0) in r and ("r2", 0) in r and ("r1", 0) not in r and ("r4", 1) not in r


def test_launcher_refuses_ids_outside_the_rule():
    from lightning_harness.launcher.identity import RolloutSpec
    from lightning_harness.launcher.tasks import Task

    with pytest.raises(InvalidId, match="rollout id"):
        RolloutSpec("bad\nid", "run", Task("t", {}), "g", 0)
    spec = RolloutSpec("good", "run", Task("t", {}), "g", 0)
    with pytest.raises(InvalidId, match="attempt"):
        spec.credential(2**31)


# -- what a harness can and cannot do --------------------------------------------------------------
def test_harness_credential_cannot_drive_the_control_api(proxy):
    env = proxy.env_for("atk", 0)
    cred = credential_of(env)
    for bearer in (cred, f"atk~0:{cred}"):
        c = ProxyControl(proxy.reverse_url, bearer)
        for call in (c.pause, c.resume, c.state, c.flush, partial(c.set_model_version, 99),
                     partial(c.reward, "victim", 0, 1.0), partial(c.end, "victim", 0), partial(c.drain, 0.1)):
            with pytest.raises(ProxyError, match="401"):
                call()
    h = {"Authorization": f"Bearer {cred}"}
    with httpx.Client(proxy=env["HTTP_PROXY"], trust_env=False, timeout=30) as c:
        assert c.post("http://lightning.proxy/_lh/pause", headers=h).status_code == 401
        assert c.post(f"{env['OPENAI_BASE_URL'][:-3]}/_lh/pause", headers=h).status_code == 401  # via /lh/ prefix
        assert c.post(f"{proxy.reverse_url}/_lh/model_version", json={"version": 5}, headers=h).status_code == 401
    st = proxy.control.state()
    assert st["paused"] is False and st["model_version"] == 0


def test_credential_is_bound_to_its_own_rollout_and_attempt(proxy, stub_server):
    atk = proxy.env_for("atk", 0)
    cred = credential_of(atk)
    before = len(stub_server.requests())
    with httpx.Client(trust_env=False, timeout=30) as c:
        for user in ("victim~0", "victim", "atk~1"):  # another rollout, or another attempt of its own
            base = f"{proxy.reverse_url}/lh/{user}/{cred}"
            assert c.post(base + "/v1/chat/completions", json=BODY).status_code == 401
            assert c.post(base + "/reward", json={"reward": 1.0}).status_code == 401
            h = {"X-Lightning-Rollout": user, "X-Lightning-Token": cred}
            assert c.post(proxy.reverse_url + "/v1/chat/completions", json=BODY, headers=h).status_code == 401
    forged = atk["HTTP_PROXY"].replace("atk~0:", "victim~0:")
    with httpx.Client(proxy=forged, trust_env=False, timeout=30) as c:
        assert c.post("http://api.openai.com/v1/chat/completions", json=BODY).status_code == 407
        assert c.post("http://lightning.proxy/reward", json={"reward": 1.0}).status_code == 407
    with httpx.Client(trust_env=False, timeout=30) as c:  # its own identity still works
        assert c.post(atk["OPENAI_BASE_URL"] + "/chat/completions", json=BODY).status_code == 200
        assert c.post(atk["LIGHTNING_REWARD_URL"], json={"reward": 0.5}).status_code == 200
    assert [(s["rollout_id"], s["attempt"]) for s in read_spans(proxy)] == [("atk", 0)]
    assert [(r["rollout_id"], r["attempt"]) for r in read_rewards(proxy)] == [("atk", 0)]
    assert len(stub_server.requests()) == before + 1


def test_ended_attempt_is_refused_everywhere_even_in_an_open_tunnel(proxy):
    import ssl

    env = proxy.env_for("ending", 2)
    tls = ssl.create_default_context(cafile=str(proxy.ca_bundle))
    with httpx.Client(proxy=env["HTTPS_PROXY"], verify=tls, trust_env=False, timeout=30) as tunnel, \
            httpx.Client(trust_env=False, timeout=30) as rev, \
            httpx.Client(proxy=env["HTTP_PROXY"], trust_env=False, timeout=30) as fwd:
        assert tunnel.post("https://api.openai.com/v1/chat/completions", json=BODY).status_code == 200
        assert rev.post(env["OPENAI_BASE_URL"] + "/chat/completions", json=BODY).status_code == 200
        assert proxy.control.end("ending", 2)["ended"] == "ending~2"
        assert tunnel.post("https://api.openai.com/v1/chat/completions", json=BODY).status_code == 407
        assert rev.post(env["OPENAI_BASE_URL"] + "/chat/completions", json=BODY).status_code == 401
        r = rev.post(env["LIGHTNING_REWARD_URL"], json={"reward": 1.0})
        assert r.status_code == 401 and "ending~2 has ended" in r.text
        assert fwd.post("http://api.openai.com/v1/chat/completions", json=BODY).status_code == 407
        assert fwd.post("http://lightning.proxy/reward", json={"reward": 1.0}).status_code == 407
        nxt = proxy.env_for("ending", 3)  # the retry gets a fresh credential
        assert rev.post(nxt["OPENAI_BASE_URL"] + "/chat/completions", json=BODY).status_code == 200
    assert sorted((s["rollout_id"], s["attempt"]) for s in read_spans(proxy)) == [("ending", 2), ("ending", 2),
                                                                                  ("ending", 3)]
    assert read_rewards(proxy) == []


def test_a_post_begun_before_the_end_and_finished_after_it_is_refused(proxy):
    """A stalled reward POST: headers (credential checked) before /_lh/end, body after it."""
    import socket
    import time

    env = proxy.env_for("stall", 0)
    u = urllib.parse.urlsplit(env["LIGHTNING_REWARD_URL"])
    body = b'{"reward": 1.0}'
    head = f"POST {u.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head.encode())
        time.sleep(0.5)
        proxy.control.end("stall", 0)
        s.sendall(body)
        answer = http.client.HTTPResponse(s)
        answer.begin()
        status, text = answer.status, answer.read().decode()
    assert status == 401 and "stall~0 has ended" in text
    assert read_rewards(proxy) == []


# -- control calls never leave the proxy -------------------------------------------------------------
def test_control_calls_are_answered_by_the_proxy_never_forwarded(make_proxy, recorder, tmp_path):
    p = make_proxy(upstreams=[recorder.url], flush_seconds=3600)
    env = p.env_for("ctl", 0)
    with httpx.Client(trust_env=False, timeout=30) as c:
        assert c.post(env["OPENAI_BASE_URL"] + "/chat/completions", json=BODY).status_code == 200
    assert len(recorder.seen) == 1  # the model call reached the upstream; now break the disk
    spans = p.traces_dir / "spans"
    subprocess.run(["rm", "-rf", str(spans)], check=True)
    spans.write_text("not a directory")
    # A flush that cannot write is answered by the proxy with its health (not forwarded, not a 2xx
    # from somewhere else): healthy false and the storage error.
    state = p.control.flush()
    assert state["healthy"] is False and state["capture_error"]
    bearer = {"Authorization": f"Bearer {p.control_token}"}
    wrong = {"Authorization": "Bearer wrong"}

    def unhealthy(answer) -> bool:
        return answer.status_code == 200 and answer.json()["healthy"] is False

    with httpx.Client(trust_env=False, timeout=30) as c:
        assert unhealthy(c.post(p.reverse_url + "/_lh/flush", headers=bearer))
        assert c.post(p.reverse_url + "/_lh/nope", headers=bearer).status_code == 404
        assert c.get(p.reverse_url + "/_lh/state", headers=wrong).status_code == 401
        assert c.get(p.reverse_url + "/_lh", headers=wrong).status_code == 401
        assert unhealthy(c.post(env["OPENAI_BASE_URL"][:-3] + "/_lh/flush", headers=bearer))
    with httpx.Client(proxy=env["HTTP_PROXY"], trust_env=False, timeout=30) as c:
        assert unhealthy(c.post("http://lightning.proxy/_lh/flush", headers=bearer))
        assert unhealthy(c.post(p.reverse_url + "/_lh/flush", headers=bearer))  # aimed at the reverse listener
        assert c.get("http://lightning.proxy/anything", headers=wrong).status_code == 401
    assert len(recorder.seen) == 1 and "/_lh" not in recorder.seen[0]["path"]
    assert not any(s in json.dumps(recorder.seen) for s in [*secrets_of(p), credential_of(env)])
    subprocess.run(["rm", "-f", str(spans)], check=True)  # disk back: the buffered span is not lost
    assert [s["rollout_id"] for s in read_spans(p)] == ["ctl"]


# -- ids and log lines ----------------------------------------------------------------------------------
def _basic(user: str, secret: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode()


def test_bad_ids_get_400_naming_the_rule_and_forge_no_log_line(proxy, stub_server):
    before = len(stub_server.requests())
    bad_users = ["a\r\nFORGED refused line", "a\x00b", "x" * 100_000, "a~" + "9" * 25, f"a~{2**31}", "a~-1"]
    with httpx.Client(trust_env=False, timeout=60) as c:
        h = {"X-Lightning-Rollout": "x" * 100_000, "X-Lightning-Token": "x"}  # httpx caps URLs at 64 KB
        r = c.post(proxy.reverse_url + "/v1/chat/completions", json=BODY, headers=h)
        assert r.status_code == 400 and "rollout id is 1..255" in r.text
        for user in (u for u in bad_users if len(u) < 1000):
            r = c.post(f"{proxy.reverse_url}/lh/{urllib.parse.quote(user)}/whatever/v1/chat/completions", json=BODY)
            assert r.status_code == 400, (user[:20], r.status_code)
            assert ("rollout id is 1..255 characters of [A-Za-z0-9._-]" in r.text
                    or "attempt is an integer 0..2147483647" in r.text)
            r = c.post(f"{proxy.reverse_url}/lh/{urllib.parse.quote(user)}/whatever/reward", json={"reward": 1})
            assert r.status_code == 400
    with httpx.Client(proxy=proxy.forward_url, trust_env=False, timeout=60) as c:
        for user in bad_users:
            h = {"Proxy-Authorization": _basic(user, "x")}
            assert c.post("http://api.openai.com/v1/chat/completions", json=BODY, headers=h).status_code == 400
    ctl = {"Authorization": f"Bearer {proxy.control_token}"}
    with httpx.Client(trust_env=False, timeout=30) as c:
        for body, rule in (({"rollout_id": "a\r\nb", "attempt": 0, "reward": 1}, "rollout id"),
                           ({"rollout_id": "x" * 100_000, "attempt": 0, "reward": 1}, "rollout id"),
                           ({"rollout_id": "a", "attempt": 2**64, "reward": 1}, "attempt is an integer"),
                           ({"rollout_id": "a", "attempt": True, "reward": 1}, "attempt is an integer"),
                           ({"rollout_id": "a", "attempt": "7", "reward": 1}, "attempt is an integer")):
            r = c.post(proxy.reverse_url + "/_lh/reward", json=body, headers=ctl)
            assert r.status_code == 400 and rule in r.text
            assert c.post(proxy.reverse_url + "/_lh/end", json=body, headers=ctl).status_code == 400
        for v in (2**63, -1, 1.5, "7"):
            r = c.post(proxy.reverse_url + "/_lh/model_version", json={"version": v}, headers=ctl)
            assert r.status_code == 400 and "model version is an integer 0..9223372036854775807" in r.text
        assert c.post(proxy.reverse_url + "/_lh/model_version", json={"version": 2**63 - 1},
                      headers=ctl).status_code == 200
    assert proxy.control.state()["rewards_captured"] == 0
    assert len(stub_server.requests()) == before
    proxy.stop()
    text = proxy.log_path.read_text(errors="replace")
    assert "refused" in text and "\\r\\n" in text  # logged, escaped
    assert not any(line.startswith("FORGED") for line in text.splitlines())
    assert "\x00" not in text and max(len(line) for line in text.splitlines()) < 2000


def test_the_proxy_log_never_holds_a_token_or_credential(proxy):
    env = proxy.env_for("logged", 1)
    with httpx.Client(trust_env=False, timeout=30) as c:
        assert c.post(env["OPENAI_BASE_URL"] + "/chat/completions", json=BODY).status_code == 200
        wrong = env["OPENAI_BASE_URL"].replace("logged~1", "other~1")  # refused: the path is logged
        assert c.post(wrong + "/chat/completions", json=BODY).status_code == 401
        old_style = f"{proxy.reverse_url}/lh/logged~1/{proxy.token}/v1"  # the token itself is no credential
        assert c.post(old_style + "/chat/completions", json=BODY).status_code == 401
    proxy.stop()
    text = proxy.log_path.read_text()
    assert "refused" in text and "/lh/other~1/***" in text
    for s in [*secrets_of(proxy), credential_of(env)]:
        assert s not in text


def test_refusals_as_fast_as_a_harness_sends_them_do_not_fill_the_log(proxy):
    """A harness decides how often it is refused, and each refusal logs a line: as fast as the proxy
    answered, the log grew by megabytes a minute, with nothing to trim it. 2,000 refused calls: the
    log keeps the first 100 such lines and about one a second after; every refusal is still counted;
    the next line logged after a pause says how many were left out, and shutdown says the rest."""
    env = proxy.env_for("noisy", 1)
    wrong = env["OPENAI_BASE_URL"].replace("noisy~1", "other~1") + "/chat/completions"
    before = proxy.control.state()["rejected"]
    t0 = time.monotonic()
    with httpx.Client(trust_env=False, timeout=30) as c:
        for n in (2000, 50):
            for _ in range(n):
                assert c.post(wrong, json=BODY).status_code == 401
            time.sleep(1.5)  # (the first of the next burst says how many of this one were left out)
    took = time.monotonic() - t0
    assert proxy.control.state()["rejected"] - before == 2050
    proxy.stop()
    text = proxy.log_path.read_text()
    lines = [ln for ln in text.splitlines() if "refused POST" in ln and "/lh/other~1/" in ln]
    assert 100 < len(lines) <= 100 + took + 3, (len(lines), took)
    said = sum(int(ln.rsplit("[", 1)[1].split()[0]) for ln in lines if ln.endswith("more lines from here not logged]"))
    assert said > 1000
    at_stop = ast.literal_eval(text.split("log lines left out since their last line: ", 1)[1].split("\n", 1)[0])
    refusals_at_stop = sum(n for site, n in at_stop.items() if site.startswith("attribution.py:"))
    assert len(lines) + said + refusals_at_stop == 2050, (len(lines), said, at_stop)


# -- what a harness receives ------------------------------------------------------------------------
def test_printed_env_holds_neither_token(proxy):
    cmd = [proxy_python(), "-m", "lightning_harness.proxy", "env", "printed", "--attempt", "2", "--token", proxy.token,
           "--forward-port", str(proxy.forward_port), "--reverse-port", str(proxy.reverse_port),
           "--confdir", str(proxy.confdir), "--format", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "LIGHTNING_PROXY_CONTROL_TOKEN": proxy.control_token}).stdout
    env = json.loads(out)
    assert env == harness_env("printed", 2, proxy.token, proxy.forward_url, proxy.reverse_url, proxy.ca_bundle)
    assert proxy.token not in out and proxy.control_token not in out
    assert credential_of(env) == attempt_credential(proxy.token, "printed", 2)
    with httpx.Client(trust_env=False, timeout=30) as c:
        assert c.post(env["OPENAI_BASE_URL"] + "/chat/completions", json=BODY).status_code == 200
    bad = subprocess.run(cmd[:4] + ["bad\nid"] + cmd[5:], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and "rollout id is 1..255" in bad.stderr


HARNESS = (
    "import json, os, urllib.request\n"
    "out = os.environ['LIGHTNING_OUTPUT_DIR']\n"
    "json.dump(dict(os.environ), open(os.path.join(out, 'env.json'), 'w'))\n"
    "req = urllib.request.Request(os.environ['LIGHTNING_REWARD_URL'], data=b'{\"reward\": 1.0}', method='POST',\n"
    "                             headers={'Content-Type': 'application/json'})\n"
    "urllib.request.urlopen(req, timeout=30).read()\n"
)


def test_launcher_gives_no_token_and_ends_the_attempt(proxy, monkeypatch):
    from lightning_harness.launcher.attempt import WORK_DIR
    from lightning_harness.launcher.batch import run_batch

    monkeypatch.setenv("LIGHTNING_PROXY_TOKEN", proxy.token)  # the launcher's own environment holds both
    monkeypatch.setenv("LIGHTNING_PROXY_CONTROL_TOKEN", proxy.control_token)
    [res] = run_batch([{"id": "t"}], [sys.executable, "-c", HARNESS], traces_dir=proxy.traces_dir, run_id="hz",
                      proxy=proxy, timeout=120)
    assert res.state == "succeeded" and res.reward == 1.0
    dump = (proxy.traces_dir / WORK_DIR / "hz" / res.rollout_id / "0" / "out" / "env.json").read_text()
    assert proxy.token not in dump and proxy.control_token not in dump
    env = json.loads(dump)
    with httpx.Client(trust_env=False, timeout=30) as c:  # the harness is gone: so is its credential
        assert c.post(env["OPENAI_BASE_URL"] + "/chat/completions", json=BODY).status_code == 401
        assert c.post(env["LIGHTNING_REWARD_URL"], json={"reward": 5.0}).status_code == 401
    assert [r["reward"] for r in read_rewards(proxy)] == [1.0]


def test_serve_generates_a_separate_control_token_that_ctl_reads(tmp_path, stub_upstream):
    import os
    import signal
    import stat
    import time

    from conftest import free_port

    conf, fwd, rev = tmp_path / "conf", free_port(), free_port()
    base = {"PATH": os.environ["PATH"], "LIGHTNING_PROXY_TOKEN": "harness-master-secret"}
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([proxy_python(), "-m", "lightning_harness.proxy", "serve", "--traces", str(tmp_path / "t"),
                             "--upstream", stub_upstream, "--forward-port", str(fwd), "--reverse-port", str(rev),
                             "--confdir", str(conf)], env=base, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        path = conf / f"control-token-{rev}"
        url = f"http://127.0.0.1:{rev}"
        ctl = [proxy_python(), "-m", "lightning_harness.proxy", "ctl", "--url", url, "--confdir", str(conf), "state"]
        deadline = time.monotonic() + 60
        while subprocess.run(ctl, capture_output=True, env=base).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.3)
        token = path.read_text().strip()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token) >= 32 and token != "harness-master-secret"
        with pytest.raises(ProxyError, match="401"):  # the proxy token is no control token
            ProxyControl(url, "harness-master-secret").pause()
        assert ProxyControl(url, token).state()["paused"] is False
        from lightning_harness.launcher.proxy_link import ProxyLink

        link = ProxyLink.attach(url, "harness-master-secret", ca_bundle=conf / "lightning-ca-bundle.pem")
        assert link.control_token == token and link.forward_url == f"http://127.0.0.1:{fwd}"  # read from the file
        assert link.end_attempt("some-rollout", 3) is None
        bad = subprocess.run([*ctl[:-1], "model-version", str(2**63)], capture_output=True, text=True, env=base)
        assert bad.returncode == 2 and "model version is an integer 0..9223372036854775807" in bad.stderr
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert str(path) in text and token not in text and "harness-master-secret" not in text
    bad = subprocess.run([proxy_python(), "-m", "lightning_harness.proxy", "serve", "--model-version", str(2**63)],
                         capture_output=True, text=True, env=base)
    assert bad.returncode == 2 and "model version is an integer 0..9223372036854775807" in bad.stderr


SCORER = (
    "import json, os, sys, urllib.request, urllib.error\n"
    "env = json.load(open(os.path.join(os.environ['LIGHTNING_OUTPUT_DIR'], 'env.json')))\n"
    "req = urllib.request.Request(env['LIGHTNING_REWARD_URL'], data=b'{\"reward\": 9}', method='POST',\n"
    "                             headers={'Content-Type': 'application/json'})\n"
    "opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
    "try:\n"
    "    print(opener.open(req, timeout=30).status)\n"
    "except urllib.error.HTTPError as exc:\n"
    "    print(exc.code)\n"
)


def test_the_attempt_is_ended_before_the_reward_command_runs(proxy, tmp_path):
    from lightning_harness.launcher.batch import run_batch

    scorer = tmp_path / "scorer.py"
    scorer.write_text(SCORER)
    [res] = run_batch([{"id": "t"}], [sys.executable, "-c", HARNESS], traces_dir=proxy.traces_dir, run_id="rc",
                      proxy=proxy, timeout=120, reward_cmd=f"{sys.executable} {scorer}")
    assert res.state == "succeeded" and res.reward == 401.0  # the harness credential was dead already
    posted = [r["reward"] for r in read_rewards(proxy) if r["source"] == "proxy"]
    assert posted == [1.0]  # only what the harness posted while alive


# -- request targets and addresses that mean the engine -------------------------------------------
def _raw(host: str, port: int, method: str, target: str, headers: dict | None = None) -> int:
    """One request with ``target``'s bytes exactly as given (httpx would drop a fragment, http.client
    refuses non-ASCII); its status."""
    body = json.dumps({"method": "reload_weights", "kwargs": {"weights_path": "/tmp/mine"}, **BODY}).encode()
    head = {"Host": f"{host}:{port}", "Content-Type": "application/json", "Content-Length": str(len(body)),
            "Connection": "close", **(headers or {})}
    request = f"{method} {target} HTTP/1.1\r\n".encode() + b"".join(
        f"{k}: {v}\r\n".encode() for k, v in head.items()) + b"\r\n" + body
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(request)
        status_line = sock.makefile("rb").readline()
    return int(status_line.split()[1])


def test_a_fragment_in_the_target_never_reaches_the_engine(make_proxy, recorder):
    """The engine's parser ends a path at '#': '/collective_rpc#/tokenize' was classified as a token
    count and served as a weight reload; '/v1/chat/completions#/tokenize' as a generation with no
    span and no hold. Such targets (and '\\', non-ASCII) get 400, in both modes; nothing is forwarded
    or recorded."""
    p = make_proxy(upstreams=[recorder.url])
    env = p.env_for("h", 0)
    base = urllib.parse.urlsplit(env["OPENAI_BASE_URL"])
    prefix = base.path.rsplit("/v1", 1)[0]
    fwd = urllib.parse.urlsplit(env["HTTP_PROXY"])
    auth = {"Proxy-Authorization": _basic(urllib.parse.unquote(fwd.username), credential_of(env))}
    for path in ("/collective_rpc#/tokenize", "/sleep#/v1/chat/completions", "/pause#/v1/responses/x/cancel",
                 "/v1/chat/completions#/tokenize", "/v1/responses#/count_tokens", "/v1/models#x",
                 "/collective_rpc\\..\\tokenize", "/v1/chat/completions\u00e9"):
        target = prefix + path
        assert _raw(base.hostname, base.port, "POST", target) == 400, path
        assert _raw(fwd.hostname, fwd.port, "POST", recorder.url + target, auth) == 400, path
    assert recorder.seen == [] and read_spans(p) == []
    assert _raw(base.hostname, base.port, "POST", prefix + "/v1/chat/completions") == 200  # the plain one goes


def _loopback_names() -> tuple[str, ...]:
    """This machine's own name where it resolves to loopback (``/etc/hosts`` often says so): an
    alias of the engine only a lookup reveals."""
    name = socket.gethostname()
    try:
        return (name,) if socket.gethostbyname(name).startswith("127.") else ()
    except OSError:
        return ()


def test_another_spelling_of_the_engines_address_is_filtered_as_the_engine(make_proxy, recorder):
    """Forward mode: '127.1', 'LOCALHOST', '0.0.0.0', '2130706433', '[::ffff:127.0.0.1]' and a name
    for loopback reach the engine as '127.0.0.1' does; they used to be forwarded untouched
    (administration reachable, model calls without token ids). And the proxy's own reverse listener
    under such a name serves a call once, not twice (once forwarded to itself)."""
    p = make_proxy(upstreams=[recorder.url])
    env = p.env_for("h", 0)
    fwd = urllib.parse.urlsplit(env["HTTP_PROXY"])
    auth = {"Proxy-Authorization": _basic(urllib.parse.unquote(fwd.username), credential_of(env))}
    port = urllib.parse.urlsplit(recorder.url).port
    names = ("localhost", "LOCALHOST", "127.1", "0.0.0.0", "2130706433", "[::ffff:127.0.0.1]", *_loopback_names())
    for name in names:
        assert _raw(fwd.hostname, fwd.port, "POST", f"http://{name}:{port}/collective_rpc", auth) == 403, name
        assert _raw(fwd.hostname, fwd.port, "POST", f"http://{name}:{port}/v1/chat/completions", auth) == 200, name
    calls = [s for s in recorder.seen if s["path"].endswith("/chat/completions")]
    assert len(recorder.seen) == len(calls) == len(names)  # no administration went through
    assert all(json.loads(s["body"])["return_token_ids"] is True for s in calls)  # injected: the pool's
    reverse = urllib.parse.urlsplit(env["OPENAI_BASE_URL"])
    own = ("127.1", "LOCALHOST", *_loopback_names())
    for name in own:
        target = f"http://{name}:{reverse.port}{reverse.path}/chat/completions"
        assert _raw(fwd.hostname, fwd.port, "POST", target, auth) == 200, name
    spans = read_spans(p)
    assert len(spans) == len(names) + len(own) and {s["rollout_id"] for s in spans} == {"h"}  # each call once


def _outward_address() -> str | None:
    """This machine's address on its way out (not loopback), where it has one: nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
        except OSError:
            return None


def test_a_name_whose_answer_changes_reaches_where_it_was_checked_not_the_engine(make_proxy, recorder):
    """DNS rebinding. A name on the engine's port that first stood for another machine, then for
    the engine's address: routing looked it up (elsewhere: forwarded untouched), mitmproxy looked it
    up again to connect and reached the engine's administration unfiltered. The connection now goes
    to the address routing judged (the Host header stays the name); and where the answer changed
    after routing's was forgotten (a held call), the connection is refused."""
    outward = _outward_address()
    if outward is None or outward.startswith("127."):
        pytest.skip("this machine has no address but loopback: nothing else to stand for")
    port = urllib.parse.urlsplit(recorder.url).port
    elsewhere = Recorder(outward, port)  # another machine's server on the engine's port
    try:
        resolver = {"PYTHONPATH": os.pathsep.join(filter(None, (str(Path(__file__).parent / "support" / "resolver"),
                                                                os.environ.get("PYTHONPATH")))),
                    "LH_TEST_ANSWERS": f"rebind.lh.test={outward},127.0.0.1;fixed.lh.test={outward}"}
        for ttl, status in (("10", 200), ("0", 502)):
            p = make_proxy(upstreams=[recorder.url], env={**os.environ, **resolver, "LH_TEST_LOOKUP_TTL": ttl})
            env = p.env_for("h", 0)
            fwd = urllib.parse.urlsplit(env["HTTP_PROXY"])
            auth = {"Proxy-Authorization": _basic(urllib.parse.unquote(fwd.username), credential_of(env))}
            got = _raw(fwd.hostname, fwd.port, "POST", f"http://rebind.lh.test:{port}/collective_rpc",
                       {**auth, "Host": f"rebind.lh.test:{port}"})
            assert got == status, ttl
            assert recorder.seen == [], recorder.seen  # never the engine
        assert [(s["path"], s["headers"]["Host"]) for s in elsewhere.seen] == [
            ("/collective_rpc", f"rebind.lh.test:{port}")]
        got = _raw(fwd.hostname, fwd.port, "GET", f"http://fixed.lh.test:{port}/x", auth)  # a steady name: as before
        assert got == 200 and elsewhere.seen[-1]["path"] == "/x" and recorder.seen == []
    finally:
        elsewhere.close()


def test_a_model_call_with_a_trailing_slash_reaches_the_engines_path(make_proxy, recorder):
    """vLLM answers '/v1/chat/completions/' with a 307 naming its own address (the harness learnt
    the engine's URL, the span was a 307); the call now goes to the path vLLM serves."""
    p = make_proxy(upstreams=[recorder.url])
    base = p.env_for("h", 0)["OPENAI_BASE_URL"]
    with httpx.Client(trust_env=False, timeout=30) as c:
        assert c.post(base + "/chat/completions/?x=1", json=BODY).status_code == 200
    assert [s["path"] for s in recorder.seen] == ["/v1/chat/completions?x=1"]
    assert [s["status_code"] for s in read_spans(p)] == [200]


def test_a_redirect_from_the_engine_names_a_path_not_the_engine(make_proxy, recorder):
    """vLLM answers 'GET /v1/models/' with a 307 to its own address: the harness learnt where to reach
    the engine around the proxy. The Location now keeps the path and query only; another host's stays."""
    p = make_proxy(upstreams=[recorder.url])
    base = p.env_for("h", 0)["OPENAI_BASE_URL"]
    recorder.redirects.update({"/v1/models/": recorder.url + "/v1/models?a=1",
                               "/health/": "https://example.com:8443/health", "/version/": recorder.url + "//x.test/v"})
    with httpx.Client(trust_env=False, timeout=30) as c:
        got = c.get(base + "/models/")
        elsewhere = c.get(base.rsplit("/v1", 1)[0] + "/health/")
        doubled = c.get(base.rsplit("/v1", 1)[0] + "/version/")
    assert (got.status_code, got.headers["Location"]) == (307, "/v1/models?a=1")  # before: the engine's URL
    assert doubled.headers["Location"] == "/x.test/v"  # (a path, never '//x.test/v': another host)
    assert elsewhere.headers["Location"] == "https://example.com:8443/health"


def test_a_tunnel_to_the_engine_carries_http_through_the_filters_however_it_is_split(make_proxy, recorder):
    """CONNECT to the engine, then a request whose first write is 'PO' (or starts with a CRLF):
    mitmproxy took the tunnel for raw TCP and passed it through, so '/collective_rpc' ran and a
    generation went unrecorded. Tunnels now speak HTTP through the addons: 403, nothing forwarded."""
    p = make_proxy(upstreams=[recorder.url])
    env = p.env_for("h", 0)
    fwd = urllib.parse.urlsplit(env["HTTP_PROXY"])
    auth = _basic(urllib.parse.unquote(fwd.username), credential_of(env))
    engine = urllib.parse.urlsplit(recorder.url).netloc
    for first, rest in ((b"PO", b"ST /collective_rpc HTTP/1.1\r\n"), (b"\r\nPOST /collective_rpc HTTP/1.1\r\n", b"")):
        with socket.create_connection((fwd.hostname, fwd.port), timeout=30) as sock:
            sock.sendall(f"CONNECT {engine} HTTP/1.1\r\nHost: {engine}\r\nProxy-Authorization: {auth}\r\n\r\n".encode())
            reader = sock.makefile("rb")
            assert b" 200 " in reader.readline()
            while reader.readline() not in (b"\r\n", b""):
                pass
            sock.sendall(first)
            time.sleep(0.3)
            sock.sendall(rest + f"Host: {engine}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}".encode())
            status = reader.readline()
        assert b" 403 " in status or status == b"", status  # refused (or closed), never the engine's answer
    assert recorder.seen == []


def test_a_path_around_an_allowed_one_reaches_no_other_route(make_proxy, recorder):
    """vLLM mounts /metrics with a wildcard tail: '/metrics/v1/responses/x' (matched as a stored
    response read anywhere in the path), '/metrics/tokenize' (a token count by suffix) and
    '/metrics/v1/chat/completions' (a model call by suffix) all reached it. Reads and questions now
    match whole paths, and a model call goes to the engine's own path for it."""
    p = make_proxy(upstreams=[recorder.url])
    base = p.env_for("h", 0)["OPENAI_BASE_URL"]
    root = base.rsplit("/v1", 1)[0]
    with httpx.Client(trust_env=False, timeout=30) as c:
        assert c.get(root + "/metrics/v1/responses/x").status_code == 403
        assert c.post(root + "/metrics/tokenize", json={}).status_code == 403
        assert c.post(root + "/metrics/v1/chat/completions", json=BODY).status_code == 200
        assert c.post(root + "/v1/tokenize", json={}).status_code == 200  # the plain ones still go
    assert [s["path"] for s in recorder.seen] == ["/v1/chat/completions", "/v1/tokenize"]


def test_an_upstream_base_path_is_kept_for_model_calls(make_proxy, recorder):
    """vLLM behind a path prefix (an ingress's '/openai/v1'): model calls go to the prefix's
    '/v1/chat/completions' (a review found '/openai/chat/completions' after the whole-path change)."""
    p = make_proxy(upstreams=[recorder.url + "/openai/v1"])
    base = p.env_for("h", 0)["OPENAI_BASE_URL"]
    with httpx.Client(trust_env=False, timeout=30) as c:
        assert c.post(base + "/chat/completions", json=BODY).status_code == 200
        assert c.get(base + "/models").status_code == 200
    assert [s["path"] for s in recorder.seen] == ["/openai/v1/chat/completions", "/openai/v1/models"]


def test_the_proxy_under_its_public_name_serves_a_call_once(make_proxy, recorder):
    """In Kubernetes pods reach the proxy by a Service name, which resolves to no address of the proxy's
    own (a ClusterIP): a base-URL call that also went through HTTP_PROXY was dialled out and failed
    (here: the name does not resolve) or was recorded twice. ``public_hosts`` names it."""
    p = make_proxy(upstreams=[recorder.url], public_hosts=["lightning-proxy.ns.svc.example"])
    env = p.env_for("h", 0)
    fwd = urllib.parse.urlsplit(env["HTTP_PROXY"])
    auth = {"Proxy-Authorization": _basic(urllib.parse.unquote(fwd.username), credential_of(env))}
    reverse = urllib.parse.urlsplit(env["OPENAI_BASE_URL"])
    target = f"http://lightning-proxy.ns.svc.example:{reverse.port}{reverse.path}/chat/completions"
    assert _raw(fwd.hostname, fwd.port, "POST", target, auth) == 200
    assert [(s["mode"], s["routed"]) for s in read_spans(p)] == [("reverse", True)]
