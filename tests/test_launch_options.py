"""``lightning-launch run`` end to end through the real proxy, with the flags it shares with
``lightning-proxy serve`` (declared once in ProxyConfig) and the shared KEY=VALUE parser."""

from __future__ import annotations

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


def test_bad_key_value_is_a_usage_error(tmp_path, write_tasks, stub_upstream):
    tasks = write_tasks([{"id": "q1"}])
    res = launch(tasks, "--traces", tmp_path / "traces", "--upstream", stub_upstream, "--env", "NOEQUALS", "--", "true")
    assert res.returncode == 2 and "--env expects KEY=VALUE, got 'NOEQUALS'" in res.stderr
    assert not (tmp_path / "traces").exists()  # nothing started
