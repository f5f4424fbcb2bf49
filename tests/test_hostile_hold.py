"""The hold and the engine against a hostile harness (session 24's review; each failed before its fix):
a call that waited for the byte budget is held by a pause that began meanwhile (it reached the paused
engine stamped with the old model version) and refused if its attempt ended meanwhile; the training
engine's administration (vLLM's dev mode: weight reload, pause, sleep) is not reachable through the
proxy; a long run's sequence numbers never restart for a live rollout."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from fixtures_proxy import StubServer, read_spans

pytestmark = pytest.mark.timeout(300)

BIG = {"model": "m", "messages": [{"role": "user", "content": "x" * 70_000}], "max_tokens": 3}  # over 64 KiB


def _post(url: str, **kw) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=120) as c:
        return c.post(url, **kw)


def _until(check, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _budget_waiter(p, first: str, second: str) -> tuple[dict, list[threading.Thread]]:
    """``first`` holds the whole byte budget for ~2 s at the engine; ``second`` waits for it."""
    results: dict = {}

    def call(rollout, delay):
        url = p.env_for(rollout)["OPENAI_BASE_URL"] + "/chat/completions"
        results[rollout] = _post(url, json=BIG, headers={"X-Stub-Delay": str(delay)}).status_code

    threads = [threading.Thread(target=call, args=(first, 2.0)), threading.Thread(target=call, args=(second, 0))]
    threads[0].start()
    _until(lambda: p.control.state()["in_flight"] == 1)
    threads[1].start()
    time.sleep(0.5)  # the second call is in the proxy now, waiting for the budget
    return results, threads


def test_a_call_waiting_for_the_byte_budget_meets_the_pause(make_proxy):
    p = make_proxy(max_inflight_bytes=100_000)
    results, threads = _budget_waiter(p, "first", "second")
    ctl = p.control
    ctl.pause()
    drained = ctl.drain(timeout=20)
    assert drained["drained"] and drained["in_flight"] == 0
    _until(lambda: ctl.state()["held"] == 1)  # the waiter came out of the budget into the hold
    time.sleep(0.3)
    assert ctl.state()["in_flight"] == 0  # and stays there: nothing reaches the paused engine
    ctl.set_model_version(1)
    ctl.resume()
    for t in threads:
        t.join(60)
    assert results == {"first": 200, "second": 200}
    _until(lambda: len(read_spans(p)) == 2)
    versions = {s["rollout_id"]: s["model_version"] for s in read_spans(p)}
    assert versions == {"first": 0, "second": 1}  # served after the swap, stamped so


def test_a_call_waiting_for_the_byte_budget_is_refused_once_its_attempt_ended(make_proxy):
    p = make_proxy(max_inflight_bytes=100_000)
    results, threads = _budget_waiter(p, "other", "ended")
    assert p.control.end("ended", 0)["ok"]
    for t in threads:
        t.join(60)
    assert results == {"other": 200, "ended": 401}


def test_the_engines_administration_is_not_reachable_through_the_proxy(tmp_path, make_proxy):
    engine = StubServer(tmp_path)
    try:
        p = make_proxy(upstreams=[engine.url])
        base = p.env_for("h")["OPENAI_BASE_URL"]  # .../v1 of the reverse listener, with the credential
        root = base.rsplit("/v1", 1)[0]
        p.control.pause()  # such calls went through during the hold too
        for path in ("/collective_rpc", "/sleep?level=1", "/pause?mode=abort", "/v1/chat/completion%73"):
            r = _post(root + path, json={"method": "reload_weights", "kwargs": {"weights_path": "/tmp/mine"}})
            assert r.status_code == 403 and "not a model call" in r.json()["error"]["message"], (path, r.text)
        forward = p.env_for("h")["HTTP_PROXY"]
        with httpx.Client(proxy=forward, trust_env=False, timeout=30) as c:
            r = c.post(engine.url + "/pause?mode=abort", json={})
        assert r.status_code == 403
        p.control.resume()
        with httpx.Client(trust_env=False, timeout=30) as c:
            assert c.get(base + "/models").status_code == 200  # reads still go
            assert c.post(root + "/tokenize", json={"prompt": "hi"}).status_code != 403  # questions too
        assert _post(base + "/chat/completions", json={**BIG, "messages": [{"role": "user", "content": "hi"}]}
                     ).status_code == 200
    finally:
        engine.stop()


def test_sequence_numbers_of_a_live_rollout_survive_a_long_run(tmp_path):
    from lightning_harness.proxy.config import ProxyConfig
    from lightning_harness.proxy.state import ProxyState

    state = ProxyState(ProxyConfig(traces=str(tmp_path)))
    assert [state.next_seq("live", 0) for _ in range(3)] == [0, 1, 2]
    for i in range(200_001):  # that many attempts since: 256 rollouts x 800 steps
        state.next_seq(f"r{i}", 0)
        if i % 50_000 == 0:
            state.next_seq("live", 0)  # still calling now and then
    assert state.next_seq("live", 0) == 3 + 5


def _training_run(tmp_path):
    """A TrainingRun of a minimal config, nothing started: its swap is driven with stand-ins."""
    import io

    from rich.console import Console

    from lightning_harness.trainer import config as C
    from lightning_harness.trainer.loop import TrainingRun

    (tmp_path / "model").mkdir()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text('model: model\nharness: {command: ["x"]}\ntasks: {train: t.jsonl}\nupdate: {lr: 1.0e-5}\n'
                   f"run_dir: {tmp_path / 'run'}\n")
    return TrainingRun(C.load_config(cfg), console=Console(file=io.StringIO()))


def test_a_swap_that_fails_resumes_the_proxy(tmp_path, make_proxy):
    """The engine refuses to pause (or the update fails): the proxy is resumed, the engine resumed,
    and the error reaches the caller, instead of every harness held until someone stops the proxy."""
    from types import SimpleNamespace

    p = make_proxy()
    run = _training_run(tmp_path)
    calls = []

    def pause(mode):
        calls.append("pause")
        raise RuntimeError("engine busy")

    run.engine = SimpleNamespace(pause=pause, resume=lambda: calls.append("resume"), is_sleeping=lambda: False)
    run.proxy, run.progress, run.device = p, SimpleNamespace(update=lambda **k: None), "cpu"
    with pytest.raises(RuntimeError, match="engine busy"):
        run.swap(1, None, 0)
    assert calls == ["pause", "resume"]
    assert p.control.state()["paused"] is False
    assert _post(p.env_for("after")["OPENAI_BASE_URL"] + "/chat/completions",
                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200


def test_a_call_the_drain_left_in_flight_is_not_trained_on(make_proxy):
    """Found by review: a drain that timed out let the swap go on, and a call still in the engine
    (queued there, served after the reload) was recorded under the old version with no error, so it
    was trained on as the old weights' work. A call whose version changed in flight is now an error
    span (``version_changed``); calls wholly on one side of the swap are as before."""
    p = make_proxy()
    ctl, url = p.control, p.env_for("slow")["OPENAI_BASE_URL"] + "/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status = {}
    slow = threading.Thread(target=lambda: status.setdefault(
        "slow", _post(url, json=body, headers={"X-Stub-Delay": "2.0"}).status_code))
    slow.start()
    _until(lambda: ctl.state()["in_flight"] == 1)
    ctl.pause()
    assert ctl.drain(timeout=0.2)["drained"] is False
    ctl.set_model_version(1)
    ctl.resume()
    slow.join(60)
    assert status == {"slow": 200}  # the harness is answered as before
    assert _post(p.env_for("after")["OPENAI_BASE_URL"] + "/chat/completions", json=body).status_code == 200
    _until(lambda: len(read_spans(p)) == 2)
    spans = {s["rollout_id"]: (s["model_version"], s["error_kind"]) for s in read_spans(p)}
    assert spans == {"slow": (0, "version_changed"), "after": (1, None)}


def test_the_proxy_stamps_the_new_version_before_the_engine_serves_the_new_weights(tmp_path, make_proxy):
    """Found by review: the loop set the proxy's version after the engine had resumed with the new
    weights (calls it served in between kept the old number), and a reload that failed resumed the
    proxy under the old version although the engine may hold the new weights. The version is now set
    before the reload: the engine resumes under it, and a failed reload leaves the reserved number."""
    from types import SimpleNamespace

    p = make_proxy()
    run = _training_run(tmp_path)
    run.run_dir.mkdir(parents=True)
    run.state = {"checkpoint": "base", "base_model": "base"}
    seen = []

    def reload_weights(path, fail):
        seen.append(("reload", p.control.state()["model_version"]))
        if fail:
            raise RuntimeError("reload failed")
        return 0.0

    for fail in (False, True):
        run.engine = SimpleNamespace(
            pause=lambda mode: None, is_sleeping=lambda: False,
            reload_weights=lambda d, f=fail, **kw: reload_weights(d, f),
            resume=lambda: seen.append(("engine resumes", p.control.state()["model_version"])))
        run.updater = SimpleNamespace(set_lr=lambda lr: None, update=lambda table: {},
                                      save=lambda d, **kw: d)
        run.proxy, run.progress, run.device = p, SimpleNamespace(update=lambda **k: None), "cpu"
        if fail:
            with pytest.raises(RuntimeError, match="reload failed"):
                run.swap(2, None, 1)
        else:
            assert run.swap(1, None, 0)["model_version"] == 1
    assert seen == [("reload", 1), ("engine resumes", 1), ("reload", 2), ("engine resumes", 2)]
    assert p.control.state()["model_version"] == 2 and p.control.state()["paused"] is False

    # a drain that timed out: what it left in the engine is aborted there, not awaited (found by
    # review: a call with a huge max_tokens kept vLLM's pause(wait) past its HTTP timeout, ending the run)
    modes = []
    run.engine.pause, run.engine.reload_weights = modes.append, lambda d, **kw: 0.0
    run.cfg.proxy.drain_timeout_s = 0.2
    url = p.env_for("long")["OPENAI_BASE_URL"] + "/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    long = threading.Thread(target=lambda: _post(url, json=body, headers={"X-Stub-Delay": "2.0"}))
    long.start()
    _until(lambda: p.control.state()["in_flight"] == 1)
    assert run.swap(3, None, 2)["proxy/drained"] is False
    long.join(60)
    run.swap(4, None, 3)
    assert modes == ["abort", "wait"]


def test_an_answer_the_engine_aborted_is_not_trained_on(make_proxy, upstream):
    """Found by review of the abort above: after a drain that timed out, vLLM ends what was in flight
    with HTTP 200 and finish_reason 'abort' before the new version is stamped, so the partial answer
    was recorded under the old version with no error and trained on. It is 'truncated' now, JSON and
    streamed alike; the harness gets the answer as the engine sent it."""
    from fixtures_proxy import read_spans

    p = make_proxy(upstreams=[upstream.url])
    url = p.env_for("aborted")["OPENAI_BASE_URL"] + "/chat/completions"
    answer = {"id": "c", "object": "chat.completion", "model": "m", "prompt_token_ids": [1, 2],
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "par"}, "finish_reason": "abort",
                           "token_ids": [7]}], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    upstream.json(answer)
    assert _post(url, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [
        {"index": 0, "delta": {"content": "par"}, "finish_reason": None}]}
    last = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]}
    upstream.sse([chunk, last, b"data: [DONE]\n\n"])
    assert _post(url, json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                 ).status_code == 200
    _until(lambda: len(read_spans(p)) == 2)
    assert [(s["error_kind"], "aborted" in (s["error"] or "")) for s in read_spans(p)] == [("truncated", True)] * 2
