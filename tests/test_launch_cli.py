"""``lightning-launch run`` as a user runs it: a subprocess that starts its own proxy against a stub upstream."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from fixtures_launch import HARNESS, wait_dead, wait_for

pytestmark = pytest.mark.timeout(300)


def launch(*args, wait=True, **kw):
    cmd = [sys.executable, "-m", "lightning_harness.launcher.cli", "run", *map(str, args)]
    env = {**os.environ, "COLUMNS": "200"}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, **kw)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, **kw)


def common(traces, stub_upstream, proxy_confdir):
    return ["--traces", traces, "--upstream", stub_upstream, "--route-host", "api.openai.com",
            "--proxy-confdir", proxy_confdir, "--no-progress"]


def test_run_produces_spans_and_rollouts_that_join_and_a_rerun_resumes(tmp_path, write_tasks, stub_upstream,
                                                                       proxy_confdir, rows):
    tasks = write_tasks([{"id": "q1", "turns": 2, "reward": 1.0}, {"id": "q2", "turns": 1, "reward": 0.25}])
    traces = tmp_path / "traces"
    res = launch(tasks, *common(traces, stub_upstream, proxy_confdir), "--samples", 3, "-j", 3, "--", sys.executable,
                 HARNESS)
    assert res.returncode == 0, res.stderr
    assert "Reward by task" in res.stderr and "Failures by cause" in res.stderr
    assert "6/6 finished" in res.stderr
    q = f"""
        select r.group_id, count(distinct r.rollout_id) as rollouts, count(s.span_id) as calls, avg(r.reward) as reward
        from read_parquet('{traces}/rollouts/**/*.parquet') r
        join read_parquet('{traces}/spans/**/*.parquet') s using (rollout_id, attempt)
        group by 1 order by 1"""
    assert duckdb.sql(q).fetchall() == [("q1", 3, 6, 1.0), ("q2", 3, 3, 0.25)]
    assert "lightning-proxy stopped" in (traces / "launch" / "proxy.log").read_text()
    n = len(rows(traces, "rollouts"))

    again = launch(tasks, *common(traces, stub_upstream, proxy_confdir), "--samples", 3, "--", sys.executable, HARNESS)
    assert again.returncode == 0, again.stderr
    assert "resuming: 6 rollouts already finished" in again.stderr
    assert len(rows(traces, "rollouts")) == n


def test_shell_template_and_reward_cmd(tmp_path, write_tasks, stub_upstream, proxy_confdir, rows):
    tasks = write_tasks([{"id": "a", "behave": "none", "question": "it's \"2+2\"; echo pwned",
                          "answer": "it's \"2+2\"; echo pwned"},
                         {"id": "b", "behave": "none", "question": "x", "answer": "y"}])
    traces = tmp_path / "traces"
    cmd = f'{sys.executable} {HARNESS} && printf %s {{question}} > "$LIGHTNING_OUTPUT_DIR/q.txt"'
    scorer = (f"{sys.executable} -c \"import json,os,pathlib; t=json.loads(os.environ['LIGHTNING_TASK']); "
              f"print(float(pathlib.Path(os.environ['LIGHTNING_OUTPUT_DIR'], 'q.txt').read_text() == t['answer']))\"")
    res = launch(tasks, *common(traces, stub_upstream, proxy_confdir), "--cmd", cmd, "--reward-cmd", scorer)
    assert res.returncode == 0, res.stderr
    got = {r["task_id"]: (r["state"], r["reward"], r["reward_source"]) for r in rows(traces, "rollouts")}
    assert got == {"a": ("succeeded", 1.0, "command"), "b": ("succeeded", 0.0, "command")}
    assert "pwned" not in (Path(rows(traces, "rollouts")[0]["log_path"]).read_text())


def test_exit_codes_and_usage_errors(tmp_path, write_tasks, stub_upstream, proxy_confdir):
    traces = tmp_path / "traces"
    crash = write_tasks([{"id": "c", "behave": "crash"}], name="crash.jsonl")
    res = launch(crash, *common(traces, stub_upstream, proxy_confdir), "--", sys.executable, HARNESS)
    assert res.returncode == 1 and "exit code 3" in res.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n{"id": "a"}\n')
    res = launch(bad, "--upstream", stub_upstream, "--", "true")
    assert res.returncode == 2 and "bad.jsonl:2: duplicate task id 'a'" in res.stderr
    res = launch(crash, "--upstream", stub_upstream)
    assert res.returncode == 2 and "no harness command" in res.stderr
    res = launch(crash, "--", "true")
    assert res.returncode == 2 and "no model" in res.stderr
    res = launch(crash, "--upstream", stub_upstream, "--k8s", crash, "--", "true")
    assert res.returncode == 2 and "--k8s-proxy-host" in res.stderr
    assert not (traces / "rollouts").exists() or len(list((traces / "rollouts").glob("**/*.parquet"))) == 1


def test_sigterm_kills_every_harness_flushes_and_the_rerun_finishes(tmp_path, write_tasks, stub_upstream, proxy_confdir,
                                                                    rows):
    traces = tmp_path / "traces"
    hang = write_tasks([{"id": "t1", "behave": "hang"}, {"id": "t2", "behave": "hang"}], name="hang.jsonl")
    proc = launch(hang, *common(traces, stub_upstream, proxy_confdir), "--run-id", "sig", "-j", 2, "--", sys.executable,
                  HARNESS, wait=False)
    try:
        files = [traces / "launch" / "sig" / f"sig-{t}-0" / "0" / "out" / "pids.json" for t in ("t1", "t2")]
        wait_for(lambda: all(f.exists() and f.read_text() for f in files), timeout=120)
        pids = [p for f in files for p in json.loads(f.read_text()).values()]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out
    assert "run the same command again to resume" in out
    assert wait_dead(pids) == []
    assert sorted(r["state"] for r in rows(traces, "rollouts")) == ["cancelled", "cancelled"]
    assert "lightning-proxy stopped" in (traces / "launch" / "proxy.log").read_text()

    # same ids, now harmless: the re-run runs both again, as new attempts
    fixed = write_tasks([{"id": "t1"}, {"id": "t2"}], name="hang.jsonl")
    res = launch(fixed, *common(traces, stub_upstream, proxy_confdir), "--run-id", "sig", "--", sys.executable, HARNESS)
    assert res.returncode == 0, res.stderr
    final = sorted((r["rollout_id"], r["attempt"], r["state"])
                   for r in rows(traces, "rollouts") if r["state"] != "cancelled")
    assert final == [("sig-t1-0", 1, "succeeded"), ("sig-t2-0", 1, "succeeded")]


def test_uses_a_running_proxy_and_leaves_it_running(tmp_path, write_tasks, make_proxy, rows):
    proxy = make_proxy()  # writes into tmp_path/traces, like the launcher below
    traces = proxy.traces_dir
    tasks = write_tasks([{"id": "fwd", "base_url": "https://api.openai.com/v1"}, {"id": "rev"}])
    res = launch(tasks, "--traces", traces, "--proxy-url", proxy.reverse_url, "--proxy-token", proxy.token,
                 "--proxy-control-token", proxy.control_token, "--proxy-ca", proxy.ca_bundle, "--no-progress",
                 "--", sys.executable, HARNESS)
    assert res.returncode == 0, res.stderr
    assert f"forward {proxy.forward_url}" in res.stderr
    assert sorted((r["task_id"], r["state"], r["reward_source"]) for r in rows(traces, "rollouts")) == [
        ("fwd", "succeeded", "proxy"), ("rev", "succeeded", "proxy")]
    assert proxy.control.state()["rewards_written"] == 2  # still running: not ours to stop
    res = launch(tasks, "--traces", traces, "--proxy-url", proxy.reverse_url, "--proxy-token", proxy.token,
                 "--proxy-control-token", "wrong", "--no-progress", "--", sys.executable, HARNESS)
    assert res.returncode == 1 and "cannot use the proxy" in res.stderr and "401" in res.stderr


ECHO_SERVICE = Path(__file__).parent / "support" / "echo_service.py"


def test_a_harness_service_starts_beside_a_running_proxy_too(tmp_path, write_tasks, make_proxy, rows):
    """--service with --proxy-url: the service is started (and stopped) although no proxy is, and every
    harness gets its socket (a harness without it exits 7 here)."""
    proxy = make_proxy()
    traces = proxy.traces_dir
    harness = f'test -S "$LIGHTNING_HARNESS_SERVICE" || exit 7; exec {sys.executable} {HARNESS}'
    res = launch(write_tasks([{"id": "a"}, {"id": "b"}]), "--traces", traces, "--proxy-url", proxy.reverse_url,
                 "--proxy-token", proxy.token, "--proxy-control-token", proxy.control_token,
                 "--proxy-ca", proxy.ca_bundle, "--no-progress", "--service", f"{sys.executable} {ECHO_SERVICE}",
                 "--cwd", tmp_path, "--", "/bin/sh", "-c", harness)
    assert res.returncode == 0, res.stdout + res.stderr
    socket_path = re.search(r"harness service ready at (\S+)", res.stderr)[1]
    assert sorted((r["task_id"], r["state"]) for r in rows(traces, "rollouts")) == [
        ("a", "succeeded"), ("b", "succeeded")]
    assert not Path(socket_path).parent.exists()  # stopped with the batch
