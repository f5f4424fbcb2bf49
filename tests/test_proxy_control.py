"""Control API (Contract 3) and attribution: pause holds, drain, model version, rewards, auth."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import ssl
import time
import urllib.parse

import httpx
import pytest
from fixtures_launch import wait_for
from fixtures_proxy import StubServer, read_rewards, read_spans

from lightning_harness.proxy.client import ProxyControl, ProxyError
from lightning_harness.proxy.credentials import attempt_credential

pytestmark = pytest.mark.timeout(300)

MSG = [{"role": "user", "content": "hi"}]


def test_pause_holds_concurrent_requests_then_releases_all(proxy, monkeypatch):
    ctl = proxy.control
    ctl.pause()
    n = 12

    def call(i):
        env = proxy.env_for(f"held-{i}")
        with httpx.Client(proxy=env["HTTP_PROXY"], trust_env=False, timeout=120) as c:
            r = c.post(env["OPENAI_BASE_URL"] + "/chat/completions",
                       json={"model": "m", "messages": MSG, "max_tokens": 2})
            return r.status_code, time.monotonic()

    with cf.ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(call, i) for i in range(n)]
        wait_for(lambda: ctl.state()["held"] == n)
        time.sleep(0.5)
        st = ctl.state()
        assert st["held"] == n and st["paused"] and st["in_flight"] == 0
        assert not any(f.done() for f in futs)  # held, not rejected
        ctl.set_model_version(7)
        released_at = time.monotonic()
        ctl.resume()
        results = [f.result(timeout=120) for f in futs]
    assert [r[0] for r in results] == [200] * n
    assert all(t >= released_at for _, t in results)
    spans = read_spans(proxy)
    assert len(spans) == n and {s["model_version"] for s in spans} == {7}
    assert ctl.state()["held"] == 0


def test_drain_waits_for_in_flight_calls(tmp_path, make_proxy):
    slow = StubServer(tmp_path, args=["--delay", "2.0"])
    try:
        p = make_proxy(upstreams=[slow.url])
        ctl = p.control
        url = p.env_for("drain")["OPENAI_BASE_URL"] + "/chat/completions"

        def call():
            with httpx.Client(trust_env=False, timeout=120) as c:
                return c.post(url, json={"model": "m", "messages": MSG}).status_code

        with cf.ThreadPoolExecutor(3) as pool:
            futs = [pool.submit(call) for _ in range(3)]
            wait_for(lambda: ctl.state()["in_flight"] == 3)
            ctl.pause()
            short = ctl.drain(timeout=0.2)
            assert short["drained"] is False and short["in_flight"] == 3 and short["waited_s"] >= 0.2
            full = ctl.drain(timeout=60)
            assert full["drained"] is True and full["in_flight"] == 0
            assert [f.result() for f in futs] == [200] * 3
        ctl.resume()
        assert len(read_spans(p)) == 3
    finally:
        slow.stop()


def test_rewards_from_api_and_from_harness(proxy):
    ctl = proxy.control
    ctl.reward("r-api", 1, 0.5, {"correct": False, "api_key": "sk-aB3dE9gH1jK7mN0pQ4sT2vW8"})  # a real key shape
    env = proxy.env_for("r-harness", 3)
    with httpx.Client(proxy=env["HTTP_PROXY"], trust_env=False, timeout=60) as c:
        assert c.post(env["LIGHTNING_REWARD_URL"], json={"reward": 1.0, "info": {"steps": 4}}).status_code == 200
        bad = c.post(env["LIGHTNING_REWARD_URL"], json={"reward": "lots"})
        assert bad.status_code == 400 and "number" in bad.text
    with httpx.Client(trust_env=False, timeout=60) as c:  # a forged token writes nothing
        forged = env["LIGHTNING_REWARD_URL"].replace(attempt_credential(proxy.token, "r-harness", 3), "forged")
        assert c.post(forged, json={"reward": 1.0}).status_code == 401
    rows = sorted(read_rewards(proxy), key=lambda r: r["rollout_id"])
    assert [(r["rollout_id"], r["attempt"], r["reward"], r["source"]) for r in rows] == [
        ("r-api", 1, 0.5, "api"),
        ("r-harness", 3, 1.0, "proxy"),
    ]
    assert "sk-aB3d" not in rows[0]["info_json"] and '"correct": false' in rows[0]["info_json"]
    assert ctl.state()["rewards_written"] == 2
    with pytest.raises(ProxyError, match="400"):
        ctl.reward("r-api", 0, float("nan"))


def test_an_attempt_reports_its_reward_a_bounded_number_of_times(proxy):
    """Found by review: one attempt posted 1,000 reports of 60 KB in 5 s, all stored, and the launcher's
    reader then parsed them all while every attempt being judged waited. The latest report wins, so
    ``MAX_REWARD_POSTS`` are plenty: past them, 429, nothing stored; other attempts are not affected. Info
    nested past ``MAX_INFO_DEPTH`` is refused (400) like any report that is no reward."""
    from lightning_harness.schemas.rewards import MAX_INFO_DEPTH, MAX_REWARD_POSTS

    env, other = proxy.env_for("r-flood", 0), proxy.env_for("r-other", 0)
    with httpx.Client(trust_env=False, timeout=60) as c:
        deep = '{"reward": 1, "info": {"x": ' + "[" * MAX_INFO_DEPTH + "]" * MAX_INFO_DEPTH + "}}"
        assert c.post(env["LIGHTNING_REWARD_URL"], content=deep).status_code == 400
        codes = [c.post(env["LIGHTNING_REWARD_URL"], json={"reward": i / 100}).status_code
                 for i in range(MAX_REWARD_POSTS + 3)]
        assert codes == [200] * (MAX_REWARD_POSTS - 1) + [429] * 4, codes
        assert c.post(other["LIGHTNING_REWARD_URL"], json={"reward": 0.5}).status_code == 200
    rows = read_rewards(proxy)
    assert sorted(r["rollout_id"] for r in rows) == ["r-flood"] * (MAX_REWARD_POSTS - 1) + ["r-other"]


def test_control_api_requires_its_token(proxy):
    bad = ProxyControl(proxy.reverse_url, "wrong")
    with pytest.raises(ProxyError, match="401"):
        bad.pause()
    with pytest.raises(ProxyError, match="401"):
        ProxyControl(proxy.reverse_url, None).state()
    assert proxy.control.state()["paused"] is False
    # in forward mode the control API answers on the host lightning.proxy
    with httpx.Client(proxy=proxy.forward_url, trust_env=False, timeout=30) as c:
        r = c.get("http://lightning.proxy/_lh/state", headers={"Authorization": f"Bearer {proxy.control_token}"})
        assert r.status_code == 200 and r.json()["model_version"] == 0
        assert c.get("http://lightning.proxy/_lh/state").status_code == 401


def test_bad_credentials_are_refused_and_write_nothing(proxy, stub_server):
    body = {"model": "m", "messages": MSG}
    env = proxy.env_for("good")
    stub_server.post("/_stub/reset", {})  # the stub keeps the last 200 requests only: count from 0
    before = len(stub_server.requests())
    cred = attempt_credential(proxy.token, "good", 0)
    bad_proxy = env["HTTP_PROXY"].replace(cred, "nope")
    with httpx.Client(proxy=bad_proxy, trust_env=False, timeout=30) as c:  # forward http, wrong token
        assert c.post("http://api.openai.com/v1/chat/completions", json=body).status_code == 407
    with httpx.Client(proxy=proxy.forward_url, trust_env=False, timeout=30) as c:  # no credentials at all
        assert c.post("http://api.openai.com/v1/chat/completions", json=body).status_code == 407
    with httpx.Client(proxy=bad_proxy, trust_env=False, timeout=30,
                      verify=ssl.create_default_context(cafile=str(proxy.ca_bundle))) as c:
        with pytest.raises(httpx.ProxyError):  # HTTPS: the CONNECT is refused with 407
            c.post("https://api.openai.com/v1/chat/completions", json=body)
    with httpx.Client(trust_env=False, timeout=30) as c:  # reverse mode
        base = env["OPENAI_BASE_URL"]
        assert c.post(base.replace(cred, "nope") + "/chat/completions", json=body).status_code == 401
        assert c.post(proxy.reverse_url + "/v1/chat/completions", json=body).status_code == 401
        h = {"X-Lightning-Rollout": "hdr~1", "X-Lightning-Token": "nope"}
        assert c.post(proxy.reverse_url + "/v1/chat/completions", json=body, headers=h).status_code == 401
        h["X-Lightning-Token"] = attempt_credential(proxy.token, "hdr", 1)  # headers work as credentials too
        assert c.post(proxy.reverse_url + "/v1/chat/completions", json=body, headers=h).status_code == 200
    spans = read_spans(proxy)
    assert [(s["rollout_id"], s["attempt"]) for s in spans] == [("hdr", 1)]
    assert len(stub_server.requests()) == before + 1  # nothing refused reached the upstream
    assert proxy.control.state()["rejected"] >= 6


def test_two_rollouts_on_one_connection_pool_are_never_mixed(proxy):
    """Each HTTPS tunnel carries its own credentials; interleaved calls keep their rollout."""
    clients = {}
    for rid in ("x", "y"):
        env = proxy.env_for(rid)
        clients[rid] = httpx.Client(proxy=env["HTTPS_PROXY"],
                                    verify=ssl.create_default_context(cafile=str(proxy.ca_bundle)), trust_env=False,
                                    timeout=60)
    try:
        for i in range(4):
            for rid, c in clients.items():
                r = c.post("https://api.openai.com/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": f"{rid}{i}"}], "max_tokens": 1})
                assert r.status_code == 200
    finally:
        for c in clients.values():
            c.close()
    spans = read_spans(proxy)
    for s in spans:
        assert s["prompt_token_ids"][0] == ord(s["rollout_id"])
    assert sorted((s["rollout_id"], s["seq"]) for s in spans) == [(r, i) for r in ("x", "y") for i in range(4)]


def test_reward_through_forward_proxy_host(proxy):
    """A harness that only knows HTTP_PROXY can report to http://lightning.proxy/reward."""
    env = proxy.env_for("fwd-reward", 4)
    with httpx.Client(proxy=env["HTTP_PROXY"], trust_env=False, timeout=30) as c:
        assert c.post("http://lightning.proxy/reward", json={"reward": -1}).status_code == 200
    with httpx.Client(proxy=env["HTTP_PROXY"].replace(attempt_credential(proxy.token, "fwd-reward", 4), "bad"),
                      trust_env=False, timeout=30) as c:
        assert c.post("http://lightning.proxy/reward", json={"reward": 5}).status_code == 407
    rows = read_rewards(proxy)
    assert [(r["rollout_id"], r["attempt"], r["reward"]) for r in rows] == [("fwd-reward", 4, -1.0)]


def test_without_token_calls_are_accepted_and_attributed_when_possible(make_proxy):
    p = make_proxy(token="", control_token="")
    assert p.token == "" and p.control_token == ""
    body = {"model": "m", "messages": MSG, "max_tokens": 1}
    with httpx.Client(trust_env=False, timeout=30) as c:
        assert c.post(p.reverse_url + "/v1/chat/completions", json=body).status_code == 200
        assert c.post(p.env_for("open", 1)["OPENAI_BASE_URL"] + "/chat/completions", json=body).status_code == 200
        assert c.get(p.reverse_url + "/_lh/state").status_code == 200  # no control token either
    spans = read_spans(p)
    assert sorted(((s["rollout_id"] or ""), s["attempt"]) for s in spans) == [("", 0), ("open", 1)]


def test_held_request_whose_client_gave_up_is_not_forwarded(proxy, stub_server):
    """A held call whose client closed its connection is not counted as held (nobody waits for it)
    while the pause lasts, and is not forwarded on resume."""
    ctl = proxy.control
    marker = "gave-up-marker"
    ctl.pause()
    url = proxy.env_for("quitter")["OPENAI_BASE_URL"] + "/chat/completions"
    with cf.ThreadPoolExecutor(1) as pool:
        stays = pool.submit(httpx.post, proxy.env_for("stays")["OPENAI_BASE_URL"] + "/chat/completions",
                            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                            trust_env=False, timeout=60)
        wait_for(lambda: ctl.state()["held"] == 1)
        u = urllib.parse.urlsplit(url)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": marker}]}).encode()
        with socket.create_connection((u.hostname, u.port)) as quitter:
            quitter.sendall(f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_for(lambda: ctl.state()["held"] == 2)  # both held...
        wait_for(lambda: ctl.state()["held"] == 1)  # ...then only the call whose client still waits
        assert ctl.state()["paused"] and not stays.done()
        ctl.resume()
        assert stays.result().status_code == 200
    wait_for(lambda: ctl.state()["held"] == 0)
    time.sleep(0.5)
    assert not any(marker in json.dumps(r) for r in stub_server.requests())
    spans = wait_for(lambda: len(read_spans(proxy)) == 2 and read_spans(proxy))
    assert sorted((s["rollout_id"], s["error_kind"]) for s in spans) == [("quitter", "client_disconnect"),
                                                                         ("stays", None)]
    assert ctl.state()["in_flight"] == 0
