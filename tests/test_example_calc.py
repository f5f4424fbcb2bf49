"""The calculator example's pieces that need no engine: tool, task loading, reward, task splits."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

CALC = Path(__file__).resolve().parents[1] / "examples" / "calc"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"calc_{name}", CALC / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("expr,result", [("37+48", "85"), ("91-19", "72"), ("12*7", "84"),
                                         ("(2+3)*4", "20"), ("7/2", "3.5"), ("1/0", "error"),
                                         ("__import__('os')", "error"), ("2**99", "error")])
def test_calculator_tool(expr, result):
    assert load("harness").calculate(expr) == result


def reward(task: dict, output: str, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    out = tmp_path / "out.txt"
    out.write_text(output)
    args = [sys.executable, str(CALC / "reward.py"), "--output", str(out)]
    if env is None:
        args += ["--task", json.dumps(task)]
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)


def test_reward_scores_the_last_answer_line(tmp_path):
    task = {"task_id": "t", "question": "What is 2 plus 3?", "answer": "5"}
    assert reward(task, "ANSWER: 5\n", tmp_path).stdout.strip() == "1.0"
    assert reward(task, "ANSWER: 6\n", tmp_path).stdout.strip() == "0.0"
    assert reward(task, "ANSWER: 6\nANSWER: 5\n", tmp_path).stdout.strip() == "1.0"
    assert reward(task, "NO ANSWER\n", tmp_path).stdout.strip() == "0.0"
    assert reward(task, "the answer is 5\n", tmp_path).stdout.strip() == "0.0"


def test_reward_reads_the_task_file_from_the_environment(tmp_path):
    task_file = tmp_path / "task.json"
    task_file.write_text(json.dumps({"task_id": "t", "question": "?", "answer": 12}))
    import os
    env = {**os.environ, "LIGHTNING_TASK_FILE": str(task_file)}
    env.pop("LIGHTNING_TASK", None)
    assert reward({}, "ANSWER: 12\n", tmp_path, env=env).stdout.strip() == "1.0"


def test_reward_reads_the_launchers_environment_alone(tmp_path):
    """The launcher's --reward-cmd sees LIGHTNING_TASK and LIGHTNING_LOG_FILE (stdout + stderr)."""
    import os
    log = tmp_path / "harness.log"
    log.write_text("[assistant] CALC: 2+3\n[tool] RESULT: 5\n[assistant] ANSWER: 5\nANSWER: 5\n")
    env = {**os.environ, "LIGHTNING_TASK": json.dumps({"task_id": "t", "answer": "5"}),
           "LIGHTNING_LOG_FILE": str(log)}
    env.pop("LIGHTNING_TASK_FILE", None)
    done = subprocess.run([sys.executable, str(CALC / "reward.py")], capture_output=True, text=True,
                          env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert done.stdout.strip() == "1.0", done.stderr
    log.write_text("[assistant] ANSWER: 5\nNO ANSWER\n")
    done = subprocess.run([sys.executable, str(CALC / "reward.py")], capture_output=True, text=True,
                          env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert done.stdout.strip() == "0.0"


def test_reward_refuses_a_task_without_answer(tmp_path):
    done = reward({"task_id": "t", "question": "?"}, "ANSWER: 1\n", tmp_path)
    assert done.returncode != 0 and done.stdout == "" and "answer" in done.stderr


def test_task_splits_are_well_formed_and_disjoint():
    rows = {}
    for split in ("train", "eval"):
        lines = (CALC / f"tasks_{split}.jsonl").read_text().splitlines()
        rows[split] = [json.loads(line) for line in lines]
        assert len(rows[split]) >= 50
        calc = load("harness").calculate
        for row in rows[split]:
            assert {"task_id", "question", "answer"} <= set(row)
            assert calc(row["expression"]) == row["answer"]
    ids = [r["task_id"] for r in rows["train"] + rows["eval"]]
    assert len(ids) == len(set(ids))
    assert not {r["expression"] for r in rows["train"]} & {r["expression"] for r in rows["eval"]}


def test_harness_without_a_task_says_so(tmp_path):
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_TASK")}
    done = subprocess.run([sys.executable, str(CALC / "harness.py")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode != 0 and "no task" in done.stderr
