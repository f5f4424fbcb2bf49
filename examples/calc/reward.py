#!/usr/bin/env python
"""Score one calculator-agent run: 1.0 when the final ANSWER equals the task's answer, else 0.0.

The task comes from ``--task`` (a JSON string or a path to a JSON file), else LIGHTNING_TASK /
LIGHTNING_TASK_FILE; the harness output from ``--output`` (path), else LIGHTNING_LOG_FILE (the
launcher's log of the harness's stdout and stderr), else stdin. Only the last line that is exactly
``ANSWER: <number>`` counts (the harness's own trace lines on stderr start with ``[``). Prints the reward
on stdout; exits non-zero (printing nothing) only when the task itself cannot be read, so a broken setup
never looks like a failed rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path


def read_task(arg: str | None) -> dict:
    raw = arg or os.environ.get("LIGHTNING_TASK")
    if raw is None and os.environ.get("LIGHTNING_TASK_FILE"):
        raw = Path(os.environ["LIGHTNING_TASK_FILE"]).read_text()
    if raw is None:
        sys.exit("reward.py: no task (pass --task or set LIGHTNING_TASK / LIGHTNING_TASK_FILE)")
    if not raw.lstrip().startswith("{"):
        raw = Path(raw).read_text()
    task = json.loads(raw)
    if "answer" not in task:
        sys.exit(f"reward.py: task has no 'answer' field: {sorted(task)}")
    return task


def score(task: dict, output: str) -> float:
    answers = re.findall(r"^ANSWER:\s*(-?\d+)\s*$", output, flags=re.MULTILINE)
    return 1.0 if answers and answers[-1] == str(task["answer"]).strip() else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", help="task JSON or path to it (default: LIGHTNING_TASK[_FILE])")
    parser.add_argument("--output", help="file with the harness's stdout (default: LIGHTNING_LOG_FILE, else stdin)")
    args = parser.parse_args()
    task = read_task(args.task)
    path = args.output or os.environ.get("LIGHTNING_LOG_FILE")
    output = Path(path).read_text(errors="replace") if path else sys.stdin.read()
    print(score(task, output))


if __name__ == "__main__":
    main()
