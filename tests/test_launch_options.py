"""``lightning-launch run`` end to end through the real proxy, with the flags it shares with
``lightning-proxy serve`` (declared once in ProxyConfig) and the shared KEY=VALUE parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import duckdb
import pytest
from fixtures_launch import HARNESS

pytestmark = pytest.mark.timeout(300)


def launch(*args):
    cmd = [sys.executable, "-m", "lightning_harness.launcher.cli", "run", *map(str, args)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_PROXY")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**env, "COLUMNS": "200"})


def test_shared_proxy_flags_reach_the_started_proxy(tmp_path, write_tasks, stub_upstream, proxy_confdir):
    tasks = write_tasks([{"id": "q1", "turns": 2, "reward": 1.0}, {"id": "q2", "turns": 1, "reward": 0.5}])
    traces = tmp_path / "traces"
    keep = f'{sys.executable} {HARNESS} && printf %s "$SHARED" > "$LIGHTNING_OUTPUT_DIR/shared.txt"'
    scorer = (f"{sys.executable} -c \"import os,pathlib; "
              f"print(float(pathlib.Path(os.environ['LIGHTNING_OUTPUT_DIR'], 'shared.txt').read_text() == 'a=b'))\"")
    res = launch(tasks, "--traces", traces, "--upstream", stub_upstream, "--route-host", "api.openai.com",
                 "--proxy-confdir", proxy_confdir, "--proxy-token", "launch-secret", "--env", "SHARED=a=b",
                 "--no-progress", "--cmd", keep, "--reward-cmd", scorer)
    assert res.returncode == 0, res.stderr
    log = (traces / "launch" / "proxy.log").read_text()
    # the token reached the proxy by environment (it says so), never on its command line or in its log
    assert "--token $LIGHTNING_PROXY_TOKEN" in log and "launch-secret" not in log
    assert f"--confdir {proxy_confdir} --token" in log  # the CA folder it was given
    q = f"""
        select r.task_id, r.reward, count(s.span_id)
        from read_parquet('{traces}/rollouts/**/*.parquet') r
        join read_parquet('{traces}/spans/**/*.parquet') s using (rollout_id, attempt)
        group by 1, 2 order by 1"""
    assert duckdb.sql(q).fetchall() == [("q1", 1.0, 2), ("q2", 1.0, 1)]  # --env KEY=a=b split at the first '='


def test_harnesses_get_no_launcher_credentials_unless_passed_by_name(tmp_path, write_tasks, stub_upstream):
    """A harness runs model-written commands: of the launcher's environment it gets PATH, HOME and
    the like, a variable named by --pass-env, never the launcher's other variables (a cloud key)."""
    tasks = write_tasks([{"id": "q1", "turns": 1, "reward": 1.0}])
    traces = tmp_path / "traces"
    show = ('import json,os; json.dump({k: os.environ.get(k) for k in ("AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "PATH")}, '
            'open(os.path.join(os.environ["LIGHTNING_OUTPUT_DIR"], "env.json"), "w"))')
    cmd = [sys.executable, "-m", "lightning_harness.launcher.cli", "run", str(tasks), "--traces", str(traces),
           "--upstream", stub_upstream, "--no-progress", "--pass-env", "HF_*", "--", sys.executable, "-c", show]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_PROXY")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**env, "AWS_SECRET_ACCESS_KEY": "cloud-secret", "HF_TOKEN": "hub-token"})
    assert res.returncode == 0, res.stderr
    seen = json.loads(next(traces.glob("launch/*/*/0/out/env.json")).read_text())
    assert seen == {"AWS_SECRET_ACCESS_KEY": None, "HF_TOKEN": "hub-token", "PATH": os.environ["PATH"]}
    res = launch(tasks, "--traces", traces, "--upstream", stub_upstream, "--pass-env", "NOT_SET_ANYWHERE", "--", "true")
    assert res.returncode == 2 and "no variable of the launcher's environment matches NOT_SET_ANYWHERE" in res.stderr


def test_bad_key_value_is_a_usage_error(tmp_path, write_tasks, stub_upstream):
    tasks = write_tasks([{"id": "q1"}])
    res = launch(tasks, "--traces", tmp_path / "traces", "--upstream", stub_upstream, "--env", "NOEQUALS", "--", "true")
    assert res.returncode == 2 and "--env expects KEY=VALUE, got 'NOEQUALS'" in res.stderr
    assert not (tmp_path / "traces").exists()  # nothing started


def test_control_token_and_confdir_are_honoured_started_or_attached(tmp_path, write_tasks, stub_upstream):
    """--proxy-control-token reaches the proxy the launcher starts (the operator can post rewards with
    it); --proxy-confdir finds a running proxy's CA bundle and control token with --proxy-url; a proxy
    served on port 0 reports the port it got."""
    import json
    import re
    import time
    import urllib.request

    tasks = write_tasks([{"id": "q1"}])
    check = (f"{sys.executable} -c \"import json, os, urllib.request; "
             "url = os.environ['OPENAI_BASE_URL'].rsplit('/v1', 1)[0] + '/_lh/state'; "
             "req = urllib.request.Request(url, headers={'Authorization': 'Bearer operator-token-123456'}); "
             "print(urllib.request.urlopen(req, timeout=10).status)\" > \"$LIGHTNING_OUTPUT_DIR/status\"")
    res = launch(tasks, "--traces", tmp_path / "a", "--upstream", stub_upstream, "--no-progress",
                 "--proxy-control-token", "operator-token-123456", "--no-self-reward", "--cmd", check)
    assert res.returncode == 0, res.stderr
    (status,) = (tmp_path / "a" / "launch").glob("*/*/0/out/status")
    assert status.read_text().strip() == "200"

    confdir, log = tmp_path / "conf", open(tmp_path / "proxy.log", "w")
    proxy = subprocess.Popen([sys.executable, "-m", "lightning_harness.proxy", "serve", "--traces", tmp_path / "p",
                              "--upstream", stub_upstream, "--confdir", confdir, "--forward-port", "0",
                              "--reverse-port", "0"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, reverse = time.monotonic() + 60, None
        while reverse is None and time.monotonic() < deadline:
            m = re.search(r"reverse http://127.0.0.1:(\d+)", (tmp_path / "proxy.log").read_text())
            reverse = m and int(m.group(1))
            time.sleep(0.2)
        assert reverse, (tmp_path / "proxy.log").read_text()
        token = (confdir / f"control-token-{reverse}").read_text().strip()
        for _ in range(100):
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{reverse}/_lh/state",
                                             headers={"Authorization": f"Bearer {token}"})
                state = json.loads(urllib.request.urlopen(req, timeout=5).read())
                break
            except OSError:
                time.sleep(0.2)
        assert state["reverse_port"] == reverse and state["forward_port"] not in (0, None)
        res = launch(tasks, "--traces", tmp_path / "b", "--proxy-url", f"http://127.0.0.1:{reverse}",
                     "--proxy-confdir", confdir, "--no-progress", "--", "true")
        assert res.returncode == 0, res.stderr
    finally:
        proxy.terminate()
        proxy.wait(30)
        log.close()
